"""``wrapopt export``: a plan as the configuration Accelerate or Lightning reads.

Accelerate wraps by module *class* (every instance of the classes listed), with one setting
for all units: the export wraps the model's block class, see [Note: the block policy] in
``interop/policy.py``, and lists under LOSSES, in words, what it does not reproduce.
Lightning's ``ModelParallelStrategy`` (FSDP2) runs the plan itself (``lightning``); its
``FSDPStrategy`` (FSDP1, ``lightning-fsdp1``) gets the closest class policy.

Example:
    >>> from wrapopt.interop import export_plan
    >>> out = export_plan(WrapPlan.load("plan.json"), to="accelerate")  # doctest: +SKIP
    >>> print(out.text); print(out.losses)  # doctest: +SKIP
"""

from __future__ import annotations

import json
from typing import Any

import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.fingerprint import module_classes
from wrapopt.interop.common import ClassPolicy, Export, bare, check_classes, header
from wrapopt.interop.lightning import lightning_fsdp1, lightning_fsdp2
from wrapopt.interop.policy import block_policy, class_policy
from wrapopt.plan.file import WrapPlan
from wrapopt.selective import refuse_selective

__all__ = ["TARGETS", "ClassPolicy", "Export", "class_policy", "export_plan"]

# "lightning" is the FSDP2 strategy, the plan itself; "lightning-fsdp2" names it explicitly.
TARGETS = ("accelerate", "lightning", "lightning-fsdp2", "lightning-fsdp1")


def _classes_for(plan: WrapPlan, model: nn.Module | None) -> tuple[dict[str, list[str]], list[str] | None]:
    """The planned model's ``module_classes`` and parameter names (None when unknown)."""
    if model is not None:
        plan.check_model(model)
        recorded = module_classes(model)
        params = [n for n, _ in model.named_parameters()]
    else:
        recorded = plan.model.get("module_classes")
        if not isinstance(recorded, dict) or not recorded:
            raise PlanError("this plan file does not record its model's module classes (it was written by an older "
                            "wrapopt); give the model: `wrapopt export PLAN --to ... --model zoo:NAME`")
        params = plan.model.get("params")
        params = list(params) if isinstance(params, dict) else None
    check_classes(recorded)
    return recorded, params


def export_plan(plan: WrapPlan, *, to: str, model: nn.Module | None = None, source: str = "plan.json") -> Export:
    """The plan as an Accelerate config (YAML) or a Lightning strategy (Python).

    Args:
        to: one of ``TARGETS``: "accelerate", "lightning" (= "lightning-fsdp2": ModelParallelStrategy,
            whose ``configure_model`` applies the plan) or "lightning-fsdp1" (FSDPStrategy).
        model: the planned model, needed only for plan files without module classes.
        source: the plan file's path, quoted in the header and loaded by the Lightning module.
    """
    if to not in TARGETS:
        raise ValueError(f"cannot export to {to!r}; choose one of: {', '.join(TARGETS)}")
    if plan.spec.pipeline is not None:
        raise PlanError(f"this plan runs {len(plan.spec.pipeline.stages)} pipeline stages, which wrapopt cannot "
                        f"export to {to}: apply it with plan.apply(model) (FSDP2 + torch.distributed.pipelining)")
    if plan.spec.tp is not None:
        raise PlanError(f"this plan runs tensor parallelism (degree {plan.mesh.tp_size}) under FSDP, which wrapopt "
                        f"cannot export to {to}: apply it with plan.apply(model) (FSDP2)")
    if to in ("accelerate", "lightning-fsdp1"):  # whole-module checkpointing only; lightning-fsdp2 applies the plan
        refuse_selective(plan.spec, f"the {to} export")
    classes, params = _classes_for(plan, model)
    match to:
        case "accelerate":
            return _accelerate(plan, classes, params, source)
        case "lightning" | "lightning-fsdp2":
            return lightning_fsdp2(plan, source)
        case "lightning-fsdp1":
            return lightning_fsdp1(plan, class_policy(plan, classes, match_by_name=False), source)
        case _:
            raise AssertionError(to)

# -- Accelerate ---------------------------------------------------------------------------------


_ACCEL_MP = {None: "no", "float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def _accelerate(plan: WrapPlan, classes: dict[str, list[str]], params: list[str] | None, source: str) -> Export:
    pol = block_policy(plan, classes, param_names=params) or class_policy(plan, classes, match_by_name=True)
    losses = list(pol.losses)
    mesh = plan.mesh
    mp = plan.mixed_precision or {}
    param_dtype, reduce_dtype = mp.get("param_dtype"), mp.get("reduce_dtype")
    if param_dtype not in _ACCEL_MP:
        raise PlanError(f"the plan's mixed_precision.param_dtype is {str(param_dtype)[:40]!r}; it must be null, "
                        "float32, bfloat16 or float16")
    if reduce_dtype not in (None, param_dtype):
        losses.append(f"reduce_dtype {reduce_dtype} is not a config-file setting (accelerate's mixed_precision sets "
                      "the compute dtype); set FullyShardedDataParallelPlugin(mixed_precision_policy=...) in code")
    if plan.spec.forward_prefetch:
        losses.append(f"explicit forward prefetch of {plan.spec.forward_prefetch} unit(s) has no accelerate FSDP2 "
                      "setting; FSDP2's implicit prefetch applies")
    if mesh.is_hsdp and mesh.shard_size > 1:
        losses.append(f"the HSDP mesh ({mesh.replicate_size} replicas x {mesh.shard_size} shards) is not written; "
                      "fsdp_config shards over all ranks (set accelerate's ParallelismConfig dp_replicate_size / "
                      "dp_shard_size for HSDP)")
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP" if mesh.shard_size > 1 else "MULTI_GPU",  # no sharding is DDP
        "mixed_precision": _ACCEL_MP[param_dtype],
        "num_machines": mesh.num_nodes,
        "num_processes": mesh.world_size,
        "machine_rank": 0,
    }
    if mesh.shard_size > 1:
        names = sorted({bare(c) for c in pol.classes})
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP" if names else "NO_WRAP",
            **({"fsdp_transformer_layer_cls_to_wrap": ",".join(names)} if names else {}),
            "fsdp_reshard_after_forward": pol.reshard_after_forward,
            "fsdp_activation_checkpointing": pol.checkpoint,
            "fsdp_offload_params": False,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    text = header(plan, source, "Accelerate config: accelerate launch --config_file THIS_FILE train.py", losses)
    text += _yaml(config)
    return Export("accelerate", text, config, tuple(losses))


def _yaml(obj: dict[str, Any], indent: int = 0) -> str:
    """The YAML of a flat-or-nested dict of scalars (written by hand: no YAML dependency)."""
    out = []
    for k, v in obj.items():
        if isinstance(v, dict):
            out.append(" " * indent + f"{k}:\n" + _yaml(v, indent + 2).rstrip("\n"))
        else:
            out.append(" " * indent + f"{k}: {_yaml_scalar(v)}")
    return "\n".join(out) + "\n"


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return repr(v)
    text = str(v)
    # A plain word (a letter first, then letters, digits and _-.,/) cannot start YAML structure;
    # anything else is a double-quoted scalar, which JSON's escaping writes exactly.
    plain = text and (text[0].isascii() and text[0].isalpha() or text[0] == "_") and all(
        ch.isascii() and (ch.isalnum() or ch in "_-.,/") for ch in text)
    reserved = text.lower() in ("yes", "no", "on", "off", "true", "false", "null", "y", "n", "~")
    if not plain:
        return json.dumps(text)
    return text if not reserved else f"'{text}'"
