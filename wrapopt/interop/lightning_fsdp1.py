"""``wrapopt export --to lightning-fsdp1``: Lightning's ``FSDPStrategy`` (FSDP1) wrapping the closest classes.

FSDP1 through Lightning wraps by class, so the strategy gets the closest class policy
([Note: the closest class policy] in ``interop/policy.py``) and lists under LOSSES what it does
not reproduce. Plan strings reach the code through repr or checked identifiers only; see
[Note: plan strings in generated text] in ``interop/common.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wrapopt.errors import PlanError
from wrapopt.interop.common import ClassPolicy, Export, bare, classes_for, few, header
from wrapopt.interop.policy import class_policy
from wrapopt.plan.file import WrapPlan
from wrapopt.selective import refuse_selective

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["export_lightning_fsdp1", "lightning_fsdp1"]

_DTYPES = (None, "float32", "bfloat16", "float16")


def export_lightning_fsdp1(plan: WrapPlan, *, model: nn.Module | None, source: str) -> Export:
    """The exporter of ``lightning-fsdp1``: the closest class policy as an ``FSDPStrategy``."""
    refuse_selective(plan.spec, "the lightning-fsdp1 export")  # whole-module checkpointing only
    classes, _ = classes_for(plan, model)
    return lightning_fsdp1(plan, class_policy(plan, classes, match_by_name=False), source)


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
