"""``wrapopt export --to fsdp1``: a Python module whose ``wrap(model)`` applies the plan with FSDP1.

The module loads the plan file and wraps with ``WrapPlan.to_fsdp1_policy()``: one
``FullyShardedDataParallel`` unit per planned module, each with its own sharding strategy,
mixed precision and prefetch. It then checkpoints the plan's checkpointed units, and
builds an HSDP plan's 2-D mesh. The policy itself lives in ``plan/fsdp1.py``, because
``WrapPlan.to_fsdp1_policy()`` is public and ``plan`` sits below ``interop``. What FSDP1
cannot express ([Note: what FSDP1 can express] in plan/fsdp1.py) is listed under LOSSES.
The plan path (relative to the module, or ``$WRAPOPT_PLAN``) reaches the code through repr only;
see [Note: plan strings in generated text] in ``interop/common.py``. CPU offload becomes FSDP1's
``CPUOffload(offload_params=True)``; the plan's accumulation and sync mode become
``ACCUMULATION``, ``SYNC`` and ``micro_batch_context(model, i)`` (``no_sync()`` for all but the last
micro-batch under sync last), which the training loop uses; See [Note: every plan field is
written, stated or lost] in wrapopt/interop/fields.py.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from wrapopt.interop.common import Export, check_classes, header, plan_path_code, plan_reference
from wrapopt.interop.fields import Accounting, state_data_and_optimizer, state_float8_compile
from wrapopt.plan.file import WrapPlan

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["export_fsdp1"]


def export_fsdp1(plan: WrapPlan, *, model: nn.Module | None, source: str, out: str | None = None) -> Export:
    """A Python module with ``wrap(model, **fsdp_kwargs)``: the model under FSDP1 in the plan's units."""
    if model is not None:
        plan.check_model(model)
    if isinstance(plan.model.get("module_classes"), dict):  # the module imports none, but a corrupt table is refused
        check_classes(plan.model["module_classes"])
    split = any(len(u.modules) > 1 for u in plan.units if not u.is_root)
    with warnings.catch_warnings():  # the losses are listed in the file instead
        warnings.simplefilter("ignore")
        policy = plan.to_fsdp1_policy(split_groups=split)  # refuses what FSDP1 cannot wrap (selective-op)
    mesh = plan.mesh
    hsdp = mesh.is_hsdp and mesh.shard_size > 1
    checkpoint = any(u.checkpoint for u in plan.units if not u.is_root)
    acc = Accounting(plan, "fsdp1")
    acc.losses += policy.losses
    acc.write("units", "reshard", "checkpoint", "prefetch", "mixed_precision", "mesh", "hsdp", "offload")
    if plan.train_config.output_dtype:
        acc.losses.append(f"output_dtype {plan.train_config.output_dtype}: FSDP1's MixedPrecision has no output cast")
    acc.state("multi_node", f"launch on {mesh.num_nodes} machines of {mesh.ranks_per_node} ranks (torchrun --nnodes "
                            f"{mesh.num_nodes} --nproc-per-node {mesh.ranks_per_node} --node-rank R --rdzv-endpoint "
                            "HOST:PORT)")
    sync = plan.train_config.accumulation_sync
    acc.state("accumulation", f"accumulation: {plan.accumulation} micro-batches per optimizer step (ACCUMULATION); "
                              "run micro-batch i's forward and backward under micro_batch_context(model, i)")
    acc.state("sync", f"sync {sync}: micro_batch_context(model, i) " + (
        "runs all but the last micro-batch under model.no_sync()" if sync == "last" else
        "syncs every micro-batch" if sync == "every" else "syncs every micro-batch (the plan records no sync mode)"))
    state_float8_compile(acc, fsdp2=False)
    state_data_and_optimizer(acc)
    acc.finish()
    settings = {
        "wrapper": "FullyShardedDataParallel",
        "units": sum(len(u.modules) for u in plan.units if not u.is_root) + 1,  # the root is a unit too
        "split_groups": split,
        "sharding_strategy": policy.root_kwargs["sharding_strategy"].name,
        "activation_checkpointing": checkpoint,
        "device_mesh": [mesh.replicate_size, mesh.shard_size] if hsdp else None,
        "plan": source,
        "cpu_offload": plan.spec.offload,
        "accumulation": plan.accumulation,
        "sync": sync if plan.accumulation > 1 else None,
    }
    what = "FSDP1: model = wrap(model, device_id=...) on every rank; the plan's units, each with its own arguments"
    text = header(plan, plan_reference(source, out), what, acc.losses, acc.script) + _module(
        plan_path_code(source, out), split=split, hsdp=hsdp, shape=(mesh.replicate_size, mesh.shard_size),
        checkpoint=checkpoint, offload=plan.spec.offload, accumulation=plan.accumulation,
        sync=settings["sync"])
    return Export("fsdp1", text, settings, tuple(acc.losses), dict(acc.status), tuple(acc.script))


def _module(path_code: str, *, split: bool, hsdp: bool, shape: tuple[int, int], checkpoint: bool, offload: bool,
            accumulation: int, sync: str | None) -> str:
    imports = ["import contextlib", "import functools" if checkpoint else "", "import os", "", "import torch"]
    if checkpoint:
        imports += ["from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (",
                    "    CheckpointImpl,", "    apply_activation_checkpointing,", "    checkpoint_wrapper,", ")"]
    if hsdp:
        imports.append("from torch.distributed.device_mesh import init_device_mesh")
    imports += ["from torch.distributed.fsdp import " + ("CPUOffload, " if offload else "")
                + "FullyShardedDataParallel", "", "from wrapopt import WrapPlan"]
    body = [
        "",
        path_code.rstrip("\n"),
        "",
        "",
        f"ACCUMULATION = {accumulation!r}  # micro-batches per optimizer step",
        f"SYNC = {sync!r}  # 'last': all but the last micro-batch run under no_sync(); 'every' or None: each syncs",
        "",
        "",
        "def micro_batch_context(model: FullyShardedDataParallel, index: int):",
        '    """The context micro-batch ``index`` (0 to ACCUMULATION - 1) of a step runs forward and backward in."""',
        '    last = index == ACCUMULATION - 1',
        '    return model.no_sync() if SYNC == "last" and not last else contextlib.nullcontext()',
        "",
        "",
        "def wrap(model: torch.nn.Module, **fsdp_kwargs) -> FullyShardedDataParallel:",
        '    """``model`` under FSDP1 in the plan\'s units (every rank calls it, after init_process_group);',
        '    ``fsdp_kwargs`` go to FullyShardedDataParallel (device_id=..., ...)."""',
        "    plan = WrapPlan.load(plan_path())",
        "    plan.check_model(model)",
        f"    policy = plan.to_fsdp1_policy(split_groups={split!r})",
        "    kwargs = {**policy.root_kwargs, **fsdp_kwargs}",
    ]
    if offload:  # policy.root_kwargs carries it too; said here, where the reader looks
        body.append('    kwargs.setdefault("cpu_offload", CPUOffload(offload_params=True))  # the plan\'s CPU offload')
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
