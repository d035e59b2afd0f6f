"""WrapPlan + model -> the FSDP2-sharded model.

``fully_shard`` is applied bottom-up (the plan's units are already ordered
innermost first, root last); a unit of several modules is one
``fully_shard([m1, m2, ...])`` call, which is also how tied parameters stay
in one unit. Activation checkpointing uses the composable ``checkpoint``,
which keeps module names unchanged. Every check runs before the first
collective, so a bad plan fails on every rank instead of hanging some.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.types import PlanSpec

__all__ = ["apply_plan", "build_mesh"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, None: None}


def build_mesh(spec: PlanSpec, device_type: str | None = None):
    """The ``DeviceMesh`` a plan runs on: 1-D ("shard",) for FSDP, 2-D
    ("replicate", "shard") for HSDP and for no sharding (shard size 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    from wrapopt.launch import device_type as default_device

    mesh = spec.mesh
    if not dist.is_initialized():
        raise PlanError("applying a plan needs a process group: start under torchrun or call wrapopt.launch.init_from_env()")
    world = dist.get_world_size()
    if world != mesh.world_size:
        raise PlanError(
            f"the plan is for {mesh.world_size} ranks but this job has {world}; "
            f"re-run the search with --world-size {world} or start {mesh.world_size} ranks"
        )
    dev = device_type or default_device()
    if mesh.is_hsdp:
        return init_device_mesh(dev, (mesh.replicate_size, mesh.shard_size), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(dev, (mesh.shard_size,), mesh_dim_names=("shard",))


def _check(model: nn.Module, spec: PlanSpec) -> dict[str, nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    modules = dict(model.named_modules())
    sharded = [n or "<root>" for n, m in modules.items() if isinstance(m, FSDPModule)]
    if sharded:
        raise PlanError(
            f"the model is already sharded (fully_shard was applied to {', '.join(sharded[:4])}); "
            "apply a plan to a fresh, unsharded model"
        )
    missing = sorted({m for u in spec.units for m in u.modules} - set(modules))
    if missing:
        raise PlanError(f"the plan names modules the model does not have: {', '.join(missing[:6])}")
    return modules


def apply_plan(
    model: nn.Module,
    spec: PlanSpec,
    *,
    mesh: Any = None,
    mixed_precision: dict[str, str | None] | None = None,
) -> nn.Module:
    """Shard ``model`` in place as ``spec`` says; returns the model (now an FSDPModule).

    Example:
        >>> model = apply_plan(model, plan.spec)  # doctest: +SKIP
    """
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    modules = _check(model, spec)  # local checks first: no collective has run yet
    if mesh is None:
        mesh = build_mesh(spec)
    mp = mixed_precision or {}
    mp_policy = MixedPrecisionPolicy(param_dtype=_DTYPES[mp.get("param_dtype")], reduce_dtype=_DTYPES[mp.get("reduce_dtype")])
    for unit in spec.units:
        if unit.checkpoint and not unit.is_root:
            for name in unit.modules:
                checkpoint(modules[name])
    fsdp_units = []
    for unit in spec.units:
        targets = [modules[n] for n in unit.modules]
        raf = unit.reshard_after_forward
        if unit.is_root:
            fully_shard(model, mesh=mesh, reshard_after_forward=raf, mp_policy=mp_policy)
        else:
            fully_shard(targets if len(targets) > 1 else targets[0], mesh=mesh, reshard_after_forward=raf, mp_policy=mp_policy)
        fsdp_units.append(targets[0])
    if spec.forward_prefetch > 0:
        _set_forward_prefetch(model, spec, modules)
    return model


def _set_forward_prefetch(model: nn.Module, spec: PlanSpec, modules: dict[str, nn.Module]) -> None:
    """Explicit forward prefetch: each unit prefetches the next ``k`` units in
    forward order (``set_modules_to_forward_prefetch``); order is taken from
    module registration order, which is forward order for block chains."""
    names = list(modules)
    units = [u for u in spec.units if not u.is_root]
    units.sort(key=lambda u: names.index(u.modules[0]))
    heads = [modules[u.modules[0]] for u in units]
    k = spec.forward_prefetch
    for i, m in enumerate(heads):
        nxt = heads[i + 1:i + 1 + k]
        if nxt:
            m.set_modules_to_forward_prefetch(nxt)  # type: ignore[attr-defined]
