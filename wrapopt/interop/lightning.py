"""Lightning exports: ``ModelParallelStrategy`` applying the plan (FSDP2) and ``FSDPStrategy`` (FSDP1).

The FSDP2 module is exact: its ``configure_model`` calls ``WrapPlan.load(path).apply`` on the
strategy's data-parallel mesh. The FSDP1 strategy wraps the closest class policy. Plan strings
reach the code through repr or checked identifiers only; see [Note: plan strings in generated text]
in ``interop/common.py``.
"""

from __future__ import annotations

from typing import Any

from wrapopt.errors import PlanError
from wrapopt.interop.common import ClassPolicy, Export, bare, few, header
from wrapopt.plan.file import WrapPlan

__all__ = ["lightning_fsdp1", "lightning_fsdp2"]

_DTYPES = (None, "float32", "bfloat16", "float16")

# [Note: the Lightning FSDP2 module]
# ModelParallelStrategy builds a 2-D DeviceMesh ("data_parallel", "tensor_parallel") before it
# calls LightningModule.configure_model, and exposes it there as self.device_mesh. A plan without
# tensor parallelism shards over all ranks, so with tensor_parallel_size=1 the "data_parallel"
# sub-mesh is the plan's 1-D mesh; an HSDP or no-shard plan needs its own 2-D (replicate, shard)
# mesh, which apply builds from the plan on the process group Lightning started (mesh=None). The
# plan's MixedPrecisionPolicy is applied by apply, so the Trainer keeps precision "32-true".
# configure_model may run more than once; the module applies the plan once.


def lightning_fsdp2(plan: WrapPlan, source: str) -> Export:
    """A Python module with ``make_strategy()`` and ``PlannedModule``, whose ``configure_model``
    applies the plan; see [Note: the Lightning FSDP2 module]."""
    mesh = plan.mesh
    one_axis = mesh.shape == (mesh.world_size,)
    settings: dict[str, Any] = {
        "strategy": "ModelParallelStrategy",
        "data_parallel_size": mesh.world_size,
        "tensor_parallel_size": 1,
        "num_nodes": mesh.num_nodes,
        "devices": mesh.world_size // mesh.num_nodes,
        "mesh": "data_parallel" if one_axis else f"built from the plan {mesh.axis_names} {mesh.shape}",
        "plan": source,
    }
    mesh_arg = 'self.device_mesh["data_parallel"]' if one_axis else "None"
    mesh_why = ("the strategy's data-parallel mesh is the plan's mesh" if one_axis else
                f"the plan's {mesh.replicate_size} x {mesh.shard_size} (replicate, shard) mesh, built by apply")
    what = "Lightning ModelParallelStrategy (FSDP2): configure_model applies the plan"
    text = header(plan, source, what, []) + f'''import torch.nn as nn
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy

from wrapopt import WrapPlan

PLAN_PATH = {source!r}
NUM_NODES = {mesh.num_nodes!r}
DEVICES_PER_NODE = {settings["devices"]!r}


def make_strategy() -> ModelParallelStrategy:
    """For Trainer(strategy=make_strategy(), devices=DEVICES_PER_NODE, num_nodes=NUM_NODES).

    Keep the Trainer's precision at "32-true": the plan's mixed precision is applied with it.
    """
    return ModelParallelStrategy(data_parallel_size={mesh.world_size!r}, tensor_parallel_size=1)


class PlannedModule(LightningModule):
    """Subclass it: set ``self.model`` (the planned model) in ``__init__``; training_step and
    configure_optimizers as usual (build the optimizer from self.parameters() after sharding)."""

    model: nn.Module

    def configure_model(self) -> None:
        if getattr(self, "_plan_applied", False):  # Lightning may call this hook more than once
            return
        # {mesh_why}
        WrapPlan.load(PLAN_PATH).apply(self.model, mesh={mesh_arg})
        self._plan_applied = True
'''
    return Export("lightning-fsdp2", text, settings, ())


def lightning_fsdp1(plan: WrapPlan, pol: ClassPolicy, source: str) -> Export:
    """Lightning's ``FSDPStrategy`` (FSDP1) wrapping the classes of ``pol`` (the closest class policy)."""
    losses = list(pol.losses)
    mesh = plan.mesh
    if mesh.shard_size == 1:
        strategy = "NO_SHARD"
    elif mesh.is_hsdp:
        strategy = "HYBRID_SHARD" if pol.reshard_after_forward else "_HYBRID_SHARD_ZERO2"
    else:
        strategy = "FULL_SHARD" if pol.reshard_after_forward else "SHARD_GRAD_OP"
    if plan.spec.forward_prefetch > 1:
        losses.append(f"FSDP1 prefetches one unit ahead at most: forward prefetch depth {plan.spec.forward_prefetch} "
                      "becomes forward_prefetch=True")
    unimportable = [c for c in pol.classes if "<locals>" in c]
    if unimportable:
        losses.append(f"classes defined inside functions cannot be imported by name: {few(unimportable)}")
    names = [c for c in pol.classes if c not in unimportable]
    kwargs: dict[str, Any] = {
        "auto_wrap_policy": names or None,
        "activation_checkpointing_policy": (names or None) if pol.checkpoint else None,
        "sharding_strategy": strategy,
        "use_orig_params": True,
    }
    if mesh.is_hsdp and mesh.shard_size > 1:
        kwargs["device_mesh"] = [mesh.replicate_size, mesh.shard_size]
    if plan.spec.forward_prefetch:
        kwargs["forward_prefetch"] = True
    mp = plan.mixed_precision or {}
    if mp.get("param_dtype") or mp.get("reduce_dtype"):
        kwargs["mixed_precision"] = {"param_dtype": mp.get("param_dtype"), "reduce_dtype": mp.get("reduce_dtype")}
    text = header(plan, source, "Lightning FSDPStrategy (FSDP1) for Trainer(strategy=strategy)", losses)
    text += _lightning_code(kwargs, source)
    return Export("lightning-fsdp1", text, kwargs, tuple(losses))


def _lightning_code(kwargs: dict[str, Any], source: str) -> str:
    classes = kwargs["auto_wrap_policy"] or []
    imports = ["from lightning.pytorch.strategies import FSDPStrategy"]
    by_module: dict[str, list[str]] = {}
    for c in classes:
        mod, _, name = c.rpartition(".")
        by_module.setdefault(mod, []).append(name)
    imports += [f"from {mod} import {', '.join(sorted(names))}" for mod, names in sorted(by_module.items())]
    args = []
    for k, v in kwargs.items():
        if k in ("auto_wrap_policy", "activation_checkpointing_policy"):
            if v:
                args.append(f"{k}={{{', '.join(bare(c) for c in v)}}}")
        elif k == "mixed_precision":
            imports[:0] = ["import torch", "from torch.distributed.fsdp import MixedPrecision"]
            if any(val not in _DTYPES for val in v.values()):
                raise PlanError(f"the plan's mixed_precision is {v!r}; its dtypes must be null, float32, bfloat16 "
                                "or float16")
            dt = {key: f"torch.{val}" if val else "None" for key, val in v.items()}
            args.append(f"mixed_precision=MixedPrecision(param_dtype={dt['param_dtype']}, "
                        f"reduce_dtype={dt['reduce_dtype']})")
        elif k == "device_mesh":
            args.append(f"device_mesh={tuple(v)!r}")
        else:
            args.append(f"{k}={v!r}")
    body = "\n".join(imports) + "\n\nstrategy = FSDPStrategy(\n" + "".join(f"    {a},\n" for a in args) + ")\n"
    body += (f"\n# Exact alternatives: FSDPStrategy(auto_wrap_policy=WrapPlan.load({source!r}).to_fsdp1_policy())"
             "\n# (FSDP1, the plan's units with per-unit arguments), or `wrapopt export --to lightning`:"
             "\n# ModelParallelStrategy with configure_model applying the plan (FSDP2, the plan itself).\n")
    return body
