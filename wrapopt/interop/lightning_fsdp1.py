"""``wrapopt export --to lightning-fsdp1``: Lightning's ``FSDPStrategy`` (FSDP1) wrapping the closest classes.

FSDP1 through Lightning wraps by class, so the strategy gets the closest class policy
([Note: the closest class policy] in ``interop/policy.py``) and lists under LOSSES what it does
not reproduce. Plan strings reach the code through repr or checked identifiers only; see
[Note: plan strings in generated text] in ``interop/common.py``. The module also defines
``TRAINER_KWARGS`` (nodes, devices, accumulation) and accounts for every plan field; See
[Note: every plan field is written, stated or lost] in wrapopt/interop/fields.py.

[Note: Lightning's accumulation under FSDP]
Lightning's Trainer(accumulate_grad_batches=N) runs the first N-1 micro-batches under
``strategy.block_backward_sync()``, which skips the sync only for a DDP model: under FSDPStrategy and
ModelParallelStrategy it does nothing, so every micro-batch reduce-scatters its gradients (sync every).
A plan scored with sync last then communicates more than predicted (and holds less): a loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wrapopt.errors import PlanError
from wrapopt.interop.common import ClassPolicy, Export, bare, classes_for, few, header, plan_reference
from wrapopt.interop.fields import Accounting, selective_as_full, state_data_and_optimizer, state_float8_compile
from wrapopt.interop.policy import class_policy
from wrapopt.plan.file import WrapPlan

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["export_lightning_fsdp1", "lightning_fsdp1", "trainer_accumulation"]

_DTYPES = (None, "float32", "bfloat16", "float16")


def export_lightning_fsdp1(plan: WrapPlan, *, model: nn.Module | None, source: str,
                           out: str | None = None) -> Export:
    """The exporter of ``lightning-fsdp1``: the closest class policy as an ``FSDPStrategy``."""
    acc = Accounting(plan, "lightning-fsdp1")
    full = selective_as_full(acc, why="FSDPStrategy's activation_checkpointing_policy checkpoints whole modules")
    classes, _ = classes_for(plan, model)
    ref = plan_reference(source, out)  # the header and comments name the plan relative to the file
    return lightning_fsdp1(plan, class_policy(full, classes, match_by_name=False), ref, acc=acc)


def trainer_accumulation(acc: Accounting, *, holds_gradients: bool = False) -> dict[str, Any]:
    """Trainer(accumulate_grad_batches=...) and the sync mode it gives: See [Note: Lightning's accumulation
    under FSDP]. ``holds_gradients``: the strategy written skips the sync on all but the last micro-batch."""
    k = acc.plan.accumulation
    if not acc.sets("accumulation"):
        return {}
    acc.write("accumulation")
    sync = acc.plan.train_config.accumulation_sync
    if sync == "last" and not holds_gradients:
        acc.lose("sync", f"SYNC MODE: the plan holds gradients unsharded until the last of its {k} micro-batches "
                         "(sync last); Lightning's Trainer reduce-scatters every micro-batch under FSDP, so each "
                         "step communicates more than predicted (it holds less); for sync last, call "
                         "set_requires_gradient_sync(False) on the FSDP modules for all but the last micro-batch "
                         "(wrapopt.train_step does), or re-run the search with --sync every", first=True)
    else:
        acc.write("sync")
    return {"accumulate_grad_batches": k}


def lightning_fsdp1(plan: WrapPlan, pol: ClassPolicy, source: str, *, acc: Accounting | None = None) -> Export:
    """Lightning's ``FSDPStrategy`` (FSDP1) wrapping the classes of ``pol`` (the closest class policy)."""
    acc = acc or Accounting(plan, "lightning-fsdp1")
    acc.losses[:0] = pol.losses
    losses = acc.losses
    acc.write("units", "reshard", "checkpoint", "mesh", "hsdp", "prefetch", "mixed_precision", "offload")
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
    if plan.train_config.output_dtype:
        losses.append(f"output_dtype {plan.train_config.output_dtype}: FSDP1's MixedPrecision has no output cast")
    if plan.spec.offload:
        kwargs["cpu_offload"] = True  # FSDPStrategy: CPUOffload(offload_params=True), the optimizer steps on the CPU
    trainer = {"num_nodes": mesh.num_nodes, "devices": mesh.world_size // mesh.num_nodes, **trainer_accumulation(acc)}
    acc.write("multi_node")
    state_float8_compile(acc, fsdp2=False)
    state_data_and_optimizer(acc)
    acc.finish()
    text = header(plan, source, "Lightning FSDPStrategy (FSDP1): Trainer(strategy=strategy, **TRAINER_KWARGS)",
                  losses, acc.script)
    text += _lightning_code(kwargs, source, trainer)
    return Export("lightning-fsdp1", text, {**kwargs, "trainer": trainer}, tuple(losses), dict(acc.status),
                  tuple(acc.script))


def _lightning_code(kwargs: dict[str, Any], source: str, trainer: dict[str, Any]) -> str:
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
    body += f"\n# Trainer(strategy=strategy, **TRAINER_KWARGS, ...)\nTRAINER_KWARGS = {trainer!r}\n"
    body += (f"\n# Exact alternatives: FSDPStrategy(auto_wrap_policy=WrapPlan.load({source!r}).to_fsdp1_policy())"
             "\n# (FSDP1, the plan's units with per-unit arguments), or `wrapopt export --to lightning`:"
             "\n# ModelParallelStrategy with configure_model applying the plan (FSDP2, the plan itself).\n")
    return body
