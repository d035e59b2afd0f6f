"""``wrapopt export --to fsdp1``: a Python module whose ``wrap(model)`` applies the plan with FSDP1.

The module loads the plan file and wraps with ``WrapPlan.to_fsdp1_policy()``: one
``FullyShardedDataParallel`` unit per planned module, each with its own sharding strategy,
mixed precision and prefetch. It then checkpoints the plan's checkpointed units, and
builds an HSDP plan's 2-D mesh. The policy itself lives in ``plan/fsdp1.py``, because
``WrapPlan.to_fsdp1_policy()`` is public and ``plan`` sits below ``interop``. What FSDP1
cannot express ([Note: what FSDP1 can express] in plan/fsdp1.py) is listed under LOSSES.
The plan path reaches the code through repr only; see [Note: plan strings in generated
text] in ``interop/common.py``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from wrapopt.interop.common import Export, header
from wrapopt.plan.file import WrapPlan

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["export_fsdp1"]


def export_fsdp1(plan: WrapPlan, *, model: nn.Module | None, source: str) -> Export:
    """A Python module with ``wrap(model, **fsdp_kwargs)``: the model under FSDP1 in the plan's units."""
    if model is not None:
        plan.check_model(model)
    split = any(len(u.modules) > 1 for u in plan.units if not u.is_root)
    with warnings.catch_warnings():  # the losses are listed in the file instead
        warnings.simplefilter("ignore")
        policy = plan.to_fsdp1_policy(split_groups=split)  # refuses what FSDP1 cannot wrap (selective-op)
    mesh = plan.mesh
    hsdp = mesh.is_hsdp and mesh.shard_size > 1
    checkpoint = any(u.checkpoint for u in plan.units if not u.is_root)
    settings = {
        "wrapper": "FullyShardedDataParallel",
        "units": sum(len(u.modules) for u in plan.units if not u.is_root) + 1,  # the root is a unit too
        "split_groups": split,
        "sharding_strategy": policy.root_kwargs["sharding_strategy"].name,
        "activation_checkpointing": checkpoint,
        "device_mesh": [mesh.replicate_size, mesh.shard_size] if hsdp else None,
        "plan": source,
    }
    what = "FSDP1: model = wrap(model, device_id=...) on every rank; the plan's units, each with its own arguments"
    text = header(plan, source, what, list(policy.losses)) + _module(source, split=split, hsdp=hsdp,
                                                                      shape=(mesh.replicate_size, mesh.shard_size),
                                                                      checkpoint=checkpoint)
    return Export("fsdp1", text, settings, tuple(policy.losses))


def _module(source: str, *, split: bool, hsdp: bool, shape: tuple[int, int], checkpoint: bool) -> str:
    imports = ["import functools" if checkpoint else "", "", "import torch"]
    if checkpoint:
        imports += ["from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (",
                    "    CheckpointImpl,", "    apply_activation_checkpointing,", "    checkpoint_wrapper,", ")"]
    if hsdp:
        imports.append("from torch.distributed.device_mesh import init_device_mesh")
    imports += ["from torch.distributed.fsdp import FullyShardedDataParallel", "", "from wrapopt import WrapPlan"]
    body = [
        "",
        f"PLAN_PATH = {source!r}",
        "",
        "",
        "def wrap(model: torch.nn.Module, **fsdp_kwargs) -> FullyShardedDataParallel:",
        '    """``model`` under FSDP1 in the plan\'s units (every rank calls it, after init_process_group);',
        '    ``fsdp_kwargs`` go to FullyShardedDataParallel (device_id=..., ...)."""',
        "    plan = WrapPlan.load(PLAN_PATH)",
        "    plan.check_model(model)",
        f"    policy = plan.to_fsdp1_policy(split_groups={split!r})",
        "    kwargs = {**policy.root_kwargs, **fsdp_kwargs}",
    ]
    if hsdp:
        body += ['    device = "cuda" if torch.cuda.is_available() else "cpu"',
                 f'    kwargs.setdefault("device_mesh", init_device_mesh(device, {shape!r}, '
                 'mesh_dim_names=("replicate", "shard")))']
    body.append("    model = FullyShardedDataParallel(model, auto_wrap_policy=policy, **kwargs)")
    if checkpoint:
        body += ["    apply_activation_checkpointing(",
                 "        model, check_fn=plan.fsdp1_checkpoint_fn(model),",
                 "        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, "
                 "checkpoint_impl=CheckpointImpl.NO_REENTRANT),",
                 "    )"]
    body.append("    return model")
    return "\n".join(imports).lstrip("\n") + "\n" + "\n".join(body) + "\n"
