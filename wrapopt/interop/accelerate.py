"""``wrapopt export --to accelerate``: a config for ``accelerate launch --config_file`` (FSDP2).

Accelerate wraps by module *class* (every instance of the classes listed), with one setting
for all units: the export wraps the model's block class, see [Note: the block policy] in
``interop/policy.py``, and lists under LOSSES, in words, what it does not reproduce.
"""

from __future__ import annotations

import json
from typing import Any

import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.interop.common import Export, bare, classes_for, header
from wrapopt.interop.policy import block_policy, class_policy
from wrapopt.plan.file import WrapPlan
from wrapopt.selective import refuse_selective

__all__ = ["export_accelerate"]


_ACCEL_MP = {None: "no", "float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def export_accelerate(plan: WrapPlan, *, model: nn.Module | None, source: str) -> Export:
    """The plan as an Accelerate config (YAML): FSDP2 wrapping the block class, one setting for all units."""
    refuse_selective(plan.spec, "the accelerate export")  # whole-module checkpointing only
    classes, params = classes_for(plan, model)
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
