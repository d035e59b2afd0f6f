"""``wrapopt export --to accelerate``: a config for ``accelerate launch --config_file`` (FSDP2).

Accelerate wraps by module *class* (every instance of the classes listed), with one setting
for all units: the export wraps the model's block class, see [Note: the block policy] in
``interop/policy.py``, and lists under LOSSES, in words, what it does not reproduce. Every other
plan field is written, stated for the script or lost: See [Note: every plan field is written,
stated or lost] in wrapopt/interop/fields.py, and [Note: Accelerate's accumulation] here.
"""

from __future__ import annotations

import json
from typing import Any

import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.interop.common import Export, bare, classes_for, header, plan_reference
from wrapopt.interop.fields import Accounting, selective_as_full, state_data_and_optimizer, state_float8_compile
from wrapopt.interop.policy import block_policy, class_policy
from wrapopt.plan.file import WrapPlan

__all__ = ["export_accelerate"]


_ACCEL_MP = {None: "no", "float32": "no", "bfloat16": "bf16", "float16": "fp16"}

# [Note: Accelerate's accumulation]
# The config file has no accumulation key (its ClusterConfig refuses unknown keys, and `accelerate
# launch --gradient_accumulation_steps` reaches the script only under DeepSpeed). Accelerator() reads
# ACCELERATE_GRADIENT_ACCUMULATION_STEPS from the environment when the script passes no steps of its own,
# and `accelerate launch` passes its environment on, so the export states the launch line with it.
# Under `with accelerator.accumulate(model):` every micro-batch but the last runs under no_sync (FSDP2:
# set_requires_gradient_sync(False)): sync last. Syncing every micro-batch needs
# GradientAccumulationPlugin(sync_each_batch=True), which is code, not config: a plan that syncs every
# micro-batch (because the held gradients of sync last do not fit) loses that, loudly.


def export_accelerate(plan: WrapPlan, *, model: nn.Module | None, source: str, out: str | None = None) -> Export:
    """The plan as an Accelerate config (YAML): FSDP2 wrapping the block class, one setting for all units."""
    acc = Accounting(plan, "accelerate")
    full = selective_as_full(acc, why="Accelerate checkpoints whole blocks")
    classes, params = classes_for(plan, model)
    pol = block_policy(full, classes, param_names=params) or class_policy(full, classes, match_by_name=True)
    acc.losses[:0] = pol.losses
    acc.write("units", "reshard", "checkpoint", "mesh")
    mesh = plan.mesh
    mp = plan.mixed_precision or {}
    param_dtype, reduce_dtype = mp.get("param_dtype"), mp.get("reduce_dtype")
    if param_dtype not in _ACCEL_MP:
        raise PlanError(f"the plan's mixed_precision.param_dtype is {str(param_dtype)[:40]!r}; it must be null, "
                        "float32, bfloat16 or float16")
    acc.write("mixed_precision")
    if reduce_dtype not in (None, param_dtype):
        acc.losses.append(f"reduce_dtype {reduce_dtype} is not a config-file setting (accelerate's mixed_precision "
                          "sets the compute dtype); set FullyShardedDataParallelPlugin(mixed_precision_policy=...) "
                          "in code")
    if plan.train_config.output_dtype:
        acc.losses.append(f"output_dtype {plan.train_config.output_dtype} is not a config-file setting; set "
                          "FullyShardedDataParallelPlugin(mixed_precision_policy=...) in code")
    acc.lose("prefetch", f"explicit forward prefetch of {plan.spec.forward_prefetch} unit(s) has no accelerate FSDP2 "
                         "setting; FSDP2's implicit prefetch applies")
    acc.lose("hsdp", f"the HSDP mesh ({mesh.replicate_size} replicas x {mesh.shard_size} shards) is not written; "
                     "fsdp_config shards over all ranks (set accelerate's ParallelismConfig dp_replicate_size / "
                     "dp_shard_size for HSDP)")
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP" if mesh.shard_size > 1 else "MULTI_GPU",  # no sharding is DDP
        "mixed_precision": _ACCEL_MP[param_dtype],
        "num_machines": mesh.num_nodes,
        "num_processes": mesh.world_size,
    }
    notes: dict[str, str] = {}
    if mesh.num_nodes > 1:
        ranks = f"0 to {mesh.num_nodes - 1}"
        notes["num_processes"] = (f"FILL IN on each of the {mesh.num_nodes} machines, here or as `accelerate launch "
                                  "--machine_rank R --main_process_ip IP --main_process_port PORT`: machine_rank "
                                  f"({ranks}, 0 on the main machine) and main_process_ip (the main machine's address, "
                                  "reachable from all)")
        acc.state("multi_node", f"on each of the {mesh.num_nodes} machines, launch with --machine_rank R ({ranks}, 0 "
                                "on the main machine) --main_process_ip IP (the main machine's address)")
    else:
        config["machine_rank"] = 0
    if mesh.shard_size > 1:
        names = sorted({bare(c) for c in pol.classes})
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP" if names else "NO_WRAP",
            **({"fsdp_transformer_layer_cls_to_wrap": ",".join(names)} if names else {}),
            "fsdp_reshard_after_forward": pol.reshard_after_forward,
            "fsdp_activation_checkpointing": pol.checkpoint,
            "fsdp_offload_params": plan.spec.offload,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
        acc.write("offload")
    else:
        acc.lose("offload", "CPU offload is not written: accelerate offloads only under FSDP, and this plan does not "
                            "shard (DDP)")
    launch = "accelerate launch --config_file THIS_FILE train.py"
    _accumulation(acc)
    if acc.sets("accumulation"):
        launch = f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={plan.accumulation} " + launch
    state_float8_compile(acc)
    state_data_and_optimizer(acc)
    acc.finish()
    text = header(plan, plan_reference(source, out), f"Accelerate config: {launch}", acc.losses, acc.script)
    text += _yaml(config, notes=notes)
    settings = {**config, **({"gradient_accumulation_steps": plan.accumulation} if acc.sets("accumulation") else {})}
    return Export("accelerate", text, settings, tuple(acc.losses), dict(acc.status), tuple(acc.script))


def _accumulation(acc: Accounting) -> None:
    """The plan's accumulation and sync mode, as Accelerate runs them: See [Note: Accelerate's accumulation]."""
    k = acc.plan.accumulation
    acc.state("accumulation", f"accumulation: launch with ACCELERATE_GRADIENT_ACCUMULATION_STEPS={k} in the "
                              "environment (the config file has no such key), build Accelerator() without steps of "
                              "its own, and run each micro-batch under `with accelerator.accumulate(model):`")
    sync = acc.plan.train_config.accumulation_sync
    if sync == "every":
        acc.lose("sync", f"SYNC MODE: the plan reduce-scatters gradients every micro-batch (sync every); "
                         f"Accelerate's accumulate() skips the sync on all but the last of the {k} micro-batches and "
                         "holds unsharded gradients meanwhile, which the plan was not scored for and may not fit: "
                         f"in code, Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps={k}, "
                         "sync_each_batch=True))", first=True)
    elif sync == "last":
        acc.state("sync", "sync last: accelerator.accumulate(model) skips the gradient sync on all but the last "
                          "micro-batch, as the plan was scored")
    else:
        acc.state("sync", "the plan does not record its sync mode; accelerator.accumulate(model) syncs on the last "
                          "micro-batch only (GradientAccumulationPlugin(sync_each_batch=True) syncs every one)")


def _yaml(obj: dict[str, Any], indent: int = 0, *, notes: dict[str, str] | None = None) -> str:
    """The YAML of a flat-or-nested dict of scalars (written by hand: no YAML dependency); ``notes``:
    comment lines after a key (no plan string reaches them)."""
    out = []
    for k, v in obj.items():
        if isinstance(v, dict):
            out.append(" " * indent + f"{k}:\n" + _yaml(v, indent + 2).rstrip("\n"))
        else:
            out.append(" " * indent + f"{k}: {_yaml_scalar(v)}")
        if notes and k in notes:
            out.append(" " * indent + f"# {notes[k]}")
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
