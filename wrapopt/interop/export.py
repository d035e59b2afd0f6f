"""``wrapopt export``: a plan as the configuration Accelerate or Lightning reads.

Both tools wrap by module *class* (every instance of the classes listed),
with one setting for all units. A plan is expressible there exactly when its
units are all the instances of some classes, one module per unit, with one
``reshard_after_forward`` and one checkpointing choice. Otherwise the export
writes the closest class-based policy and a LOSSES section saying, in words,
what it does not reproduce; see [Note: the closest class policy].

Example:
    >>> from wrapopt.export import export_plan
    >>> out = export_plan(WrapPlan.load("plan.json"), to="accelerate")  # doctest: +SKIP
    >>> print(out.text); print(out.losses)  # doctest: +SKIP
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import json
import keyword

import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.fingerprint import module_classes
from wrapopt.plan.file import WrapPlan
from wrapopt.version import __version__

__all__ = ["TARGETS", "ClassPolicy", "Export", "class_policy", "export_plan"]

TARGETS = ("accelerate", "lightning")

# [Note: the closest class policy]
# Candidates are the classes of the plan's unit modules. A class is kept when every instance of it
# is a unit module (wrapping the class then wraps nothing the plan leaves to a parent); a class
# with instances outside the plan is dropped, and its unit modules' parameters fall to the
# enclosing unit (usually the root). Accelerate matches classes by bare name, Lightning by the
# class itself, so the instance sets differ accordingly. A grouped unit of same-class modules
# (consecutive blocks) becomes one unit per module; a grouped unit of mixed classes (tied
# embedding and head) is never split, since splitting it would split the shared parameter: its
# classes are dropped. The one reshard_after_forward and checkpointing setting is the majority
# over the units kept; every unit that differs is named. Subclass instances are not seen (the plan
# records each module's own class), though both tools wrap them too.


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """The closest class-based wrapping of a plan, and what it loses."""

    classes: tuple[str, ...]  # "package.module.Class", wrapped (every instance)
    reshard_after_forward: bool
    checkpoint: bool
    losses: tuple[str, ...]  # what differs from the plan, in words


@dataclass(frozen=True, slots=True)
class Export:
    """What ``export_plan`` returns: the file text and the same settings as data."""

    target: str
    text: str
    settings: dict[str, Any]
    losses: tuple[str, ...]

    @property
    def exact(self) -> bool:
        return not self.losses


# [Note: plan strings in generated text]
# A plan file is data from anywhere, and the export writes its strings into Python (Lightning) and
# YAML (Accelerate) that a user runs. No such string may become code or structure: class paths that
# the Python imports must be dotted identifiers (checked, else PlanError naming the field); any other
# string reaches Python through repr, YAML through a JSON (double-quoted YAML) scalar unless it is a
# plain word, and a comment through _comment, which escapes every character that could end the line.


def _comment(text: object) -> str:
    """``text`` safe inside a ``#`` comment: non-printable characters (line breaks included) escaped."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(text))


def _is_dotted_identifier(path: str) -> bool:
    return all(p.isidentifier() and not keyword.iskeyword(p) for p in path.split("."))


def _check_classes(classes: dict[str, list[str]]) -> None:
    """Every class path the plan records is ``package.module.Class`` (``<locals>`` allowed)."""
    for c in classes:
        if not _is_dotted_identifier(c.replace(".<locals>.", ".")):
            raise PlanError(f"the plan file's model.module_classes names the class {c[:80]!r}, which is "
                            "not a Python class path (package.module.Class); the file was edited or corrupted: "
                            "make the plan again with `wrapopt search`, or give the model with --model zoo:NAME")


def _bare(qualname: str) -> str:
    return qualname.rsplit(".", 1)[-1]


def class_policy(plan: WrapPlan, classes: dict[str, list[str]], *, match_by_name: bool) -> ClassPolicy:
    """The closest class-based policy to ``plan``; see [Note: the closest class policy].

    Args:
        classes: ``module_classes(model)`` of the planned model.
        match_by_name: instances are all classes of that bare name (Accelerate)
            rather than of that exact class (Lightning).
    """
    cls_of = {m: c for c, mods in classes.items() for m in mods}
    key = _bare if match_by_name else (lambda c: c)
    instances: dict[str, set[str]] = {}
    for c, mods in classes.items():
        instances.setdefault(key(c), set()).update(mods)
    units = [u for u in plan.units if not u.is_root]
    unit_mods = {m for u in units for m in u.modules}
    unknown = sorted(unit_mods - set(cls_of))
    if unknown:
        raise PlanError(f"the plan's units name modules its model does not have: {_comment(', '.join(unknown[:6]))}")
    losses: list[str] = []
    mixed_groups = [u for u in units if len(u.modules) > 1 and len({key(cls_of[m]) for m in u.modules}) > 1]
    banned = {key(cls_of[m]) for u in mixed_groups for m in u.modules}
    for u in mixed_groups:
        losses.append(f"the grouped unit {' + '.join(u.modules)} ({', '.join(_bare(cls_of[m]) for m in u.modules)}) "
                      "is not wrapped: one class-based policy cannot keep modules of different classes in one unit; "
                      "its parameters go to the enclosing unit")
    in_mixed = {m for u in mixed_groups for m in u.modules}
    kept: list[str] = []
    for c in dict.fromkeys(key(cls_of[m]) for u in units for m in u.modules):
        outside = sorted(instances[c] - unit_mods, key=_order(classes))
        mine = sorted((instances[c] & unit_mods) - in_mixed, key=_order(classes))
        if c in banned:
            if mine:
                losses.append(f"{_bare(c)} units not wrapped ({_few(mine)}): {_bare(c)} is also in a grouped unit "
                              "of mixed classes; their parameters go to the enclosing unit")
        elif outside:
            losses.append(f"{_bare(c)} units not wrapped ({_few(mine)}): wrapping every {_bare(c)} would also wrap "
                          f"{len(outside)} module(s) the plan leaves to their parent ({_few(outside, 3)}); their "
                          "parameters go to the enclosing unit")
        else:
            kept.append(c)
    kept_units = [u for u in units if key(cls_of[u.modules[0]]) in kept]
    for u in kept_units:
        if len(u.modules) > 1:
            losses.append(f"the grouped unit {' + '.join(u.modules)} becomes {len(u.modules)} units of one "
                          f"{_bare(cls_of[u.modules[0]])} each")
    raf_votes = Counter(u.reshard_after_forward is not False for u in kept_units)
    raf = raf_votes[True] >= raf_votes[False]
    odd = [u.name for u in kept_units if (u.reshard_after_forward is not False) != raf]
    if odd:
        losses.append(f"units {_few(odd)} have reshard_after_forward={not raf} in the plan; the export uses "
                      f"{raf} for every unit")
    hpz = [f"{u.name} ({u.reshard_after_forward})" for u in kept_units if not isinstance(u.reshard_after_forward, bool)]
    if hpz:
        losses.append(f"reshard_after_forward=N (reshard to groups of N ranks) becomes true: {_few(hpz)}")
    ck_votes = Counter(u.checkpoint for u in kept_units)
    ckpt = bool(kept_units) and ck_votes[True] > ck_votes[False]
    odd_ck = [u.name for u in kept_units if u.checkpoint != ckpt]
    if odd_ck:
        losses.append(f"activation checkpointing is {'on' if ckpt else 'off'} for every wrapped unit, but the plan "
                      f"has it {'off' if ckpt else 'on'} for {_few(odd_ck)}")
    lost_ck = [u.name for u in units if u.checkpoint and u not in kept_units]
    if lost_ck:
        losses.append(f"checkpointing of the units not wrapped is lost: {_few(lost_ck)}")
    return ClassPolicy(tuple(kept), raf, ckpt, tuple(losses))


def _order(classes: dict[str, list[str]]):
    pos = {m: i for i, m in enumerate(m for mods in classes.values() for m in mods)}
    return lambda m: pos.get(m, 0)


def _few(items: list[str], k: int = 4) -> str:
    return ", ".join(items[:k]) + (f" and {len(items) - k} more" if len(items) > k else "")


def _classes_for(plan: WrapPlan, model: nn.Module | None) -> dict[str, list[str]]:
    if model is not None:
        plan.check_model(model)
        recorded = module_classes(model)
    else:
        recorded = plan.model.get("module_classes")
        if not isinstance(recorded, dict) or not recorded:
            raise PlanError("this plan file does not record its model's module classes (it was written by an older "
                            "wrapopt); give the model: `wrapopt export PLAN --to ... --model zoo:NAME`")
    _check_classes(recorded)
    return recorded


def export_plan(plan: WrapPlan, *, to: str, model: nn.Module | None = None, source: str = "plan.json") -> Export:
    """The plan as an Accelerate config (YAML) or a Lightning ``FSDPStrategy`` (Python).

    Args:
        to: "accelerate" or "lightning".
        model: the planned model, needed only for plan files without module classes.
        source: the plan file's path, quoted in the header.
    """
    if plan.spec.tp is not None:
        raise PlanError(f"this plan runs tensor parallelism (degree {plan.mesh.tp_size}) under FSDP, which wrapopt "
                        f"cannot export to {to}: apply it with plan.apply(model) (FSDP2)")
    classes = _classes_for(plan, model)
    match to:
        case "accelerate":
            return _accelerate(plan, classes, source)
        case "lightning":
            return _lightning(plan, classes, source)
        case _:
            raise ValueError(f"cannot export to {to!r}; choose one of: {', '.join(TARGETS)}")

# -- Accelerate ---------------------------------------------------------------------------------


_ACCEL_MP = {None: "no", "float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def _accelerate(plan: WrapPlan, classes: dict[str, list[str]], source: str) -> Export:
    pol = class_policy(plan, classes, match_by_name=True)
    losses = list(pol.losses)
    mesh = plan.mesh
    mp = plan.mixed_precision or {}
    param_dtype, reduce_dtype = mp.get("param_dtype"), mp.get("reduce_dtype")
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
        names = sorted({_bare(c) for c in pol.classes})
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP" if names else "NO_WRAP",
            **({"fsdp_transformer_layer_cls_to_wrap": ",".join(names)} if names else {}),
            "fsdp_reshard_after_forward": pol.reshard_after_forward,
            "fsdp_activation_checkpointing": pol.checkpoint,
            "fsdp_offload_params": False,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    text = _header(plan, source, "Accelerate config: accelerate launch --config_file THIS_FILE train.py", losses, "#")
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

# -- Lightning ----------------------------------------------------------------------------------


def _lightning(plan: WrapPlan, classes: dict[str, list[str]], source: str) -> Export:
    pol = class_policy(plan, classes, match_by_name=False)
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
        losses.append(f"classes defined inside functions cannot be imported by name: {_few(unimportable)}")
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
    text = _header(plan, source, "Lightning FSDPStrategy (FSDP1) for Trainer(strategy=strategy)", losses, "#")
    text += _lightning_code(kwargs, source)
    return Export("lightning", text, kwargs, tuple(losses))


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
                args.append(f"{k}={{{', '.join(_bare(c) for c in v)}}}")
        elif k == "mixed_precision":
            imports[:0] = ["import torch", "from torch.distributed.fsdp import MixedPrecision"]
            if any(val not in _ACCEL_MP for val in v.values()):
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
             "\n# (FSDP1, the plan's units with per-unit arguments), or ModelParallelStrategy with"
             f"\n# WrapPlan.load({source!r}).apply(self.model, mesh=self.device_mesh['data_parallel'])"
             "\n# in LightningModule.configure_model (FSDP2, the plan itself).\n")
    return body

# -- shared ---------------------------------------------------------------------------------------


def _header(plan: WrapPlan, source: str, what: str, losses: list[str], c: str) -> str:
    m = plan.mesh
    lines = [
        f"{what}",
        f"written by `wrapopt export` {__version__} from {source}: {len(plan.units)} units "
        f"({plan.spec.label or 'unlabelled'}) for {plan.model.get('class')} on {m.world_size} ranks",
    ]
    if losses:
        lines += ["", "LOSSES: what this configuration does not reproduce of the plan", "(for the exact plan, "
                  f"use WrapPlan.load({source!r}).apply(model) in the training script)"]
        lines += [f"  - {x}" for x in losses]
    else:
        lines += ["The plan is reproduced exactly."]
    return "".join(f"{c} {_comment(ln)}".rstrip() + "\n" for ln in lines) + "\n"
