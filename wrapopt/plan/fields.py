"""Reading the plan file: each JSON field checked and turned into the values a WrapPlan holds.

The file is read with ``json`` only: nothing in it is unpickled or evaluated.
Every error names the file and the field, and says what the field must hold;
the pointed checks run first, then the JSON schema catches the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wrapopt.assumptions import Assumptions
from wrapopt.errors import PlanError
from wrapopt.plan.check import check_plan_fields
from wrapopt.plan.schema import schema_errors, short_json
from wrapopt.plan.tp import tp_from_json
from wrapopt.spec import ROOT, SELECTIVE_OP, MeshSpec, PipelineSpec, PlanSpec, TPSpec, UnitSpec
from wrapopt.train import TrainConfig
from wrapopt.version import __version__

__all__ = ["PLAN_FORMAT", "PlanFields", "read_plan_fields"]

PLAN_FORMAT = "wrapopt.plan/1"
_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class PlanFields:
    """A plan file's fields, checked: what ``WrapPlan.from_json`` builds the plan from."""

    spec: PlanSpec
    model: dict[str, Any]  # model_fingerprint(...)
    prediction: dict[str, Any]
    fabric: dict[str, Any]
    baselines: dict[str, Any]
    mixed_precision: dict[str, str | None]
    created: str
    wrapopt_version: str
    assumptions: Assumptions | None
    train: TrainConfig | None


def read_plan_fields(data: Any, *, source: str = "<plan>") -> PlanFields:
    """The fields of the plan file ``source`` (its parsed JSON ``data``); ``PlanError`` naming the bad field."""

    def fail(fld: str, msg: str) -> PlanError:
        return _field_error(source, fld, msg)

    if not isinstance(data, dict):
        raise PlanError(f"{source}: a plan file is a JSON object, got {type(data).__name__}")
    _check_format(data, source)
    model = data.get("model")
    if (not isinstance(model, dict) or not isinstance(model.get("params"), dict)
            or not isinstance(model.get("class"), str)):
        raise fail("model", "must be an object with 'class' and 'params' (the model fingerprint)")
    mesh = data.get("mesh")
    mesh_spec = _mesh_from_json(mesh, source)
    tp = _tp_from_json(data.get("tp"), mesh_spec, source)
    pipeline = _pipeline_from_json(data.get("pipeline"), mesh_spec, source)
    units = _units_from_json(data.get("units"), source)
    offload = data.get("offload", False)
    if not isinstance(offload, bool):
        raise fail("offload", f"must be true or false, got {offload!r}")
    prefetch = data.get("forward_prefetch", 0)
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise fail("forward_prefetch", f"must be a non-negative int, got {prefetch!r}")
    mp = data.get("mixed_precision") or {"param_dtype": None, "reduce_dtype": None}
    if not isinstance(mp, dict) or any(v not in (None, "float32", "bfloat16", "float16") for v in mp.values()):
        raise fail("mixed_precision",
                   "must map param_dtype/reduce_dtype to null, 'float32', 'bfloat16' or 'float16'")
    train = TrainConfig.from_json(data["train"], source=source) if data.get("train") is not None else None
    for fld in ("prediction", "fabric", "baselines"):
        v = data.get(fld)
        if v is not None and not isinstance(v, dict):
            raise fail(fld, "must be an object")
    # The hand checks above give the pointed messages; the schema catches the rest (a typo
    # such as "reshard_after_foward" would otherwise be ignored and silently default to True).
    problems = schema_errors(data)
    if problems:
        fld, msg = problems[0]
        raise fail(fld, msg + " (see wrapopt/data/plan.schema.json)")
    for fld, want in (("shape", list(mesh_spec.shape)), ("axis_names", list(mesh_spec.axis_names))):
        if fld in mesh and mesh[fld] != want:
            raise fail(f"mesh.{fld}", f"is {short_json(mesh[fld])} but world_size, shard_size, tp_size, "
                                      f"pp_size and cp_size give {short_json(want)}; fix the sizes or drop mesh.{fld}")
    spec = PlanSpec(units=tuple(units), mesh=mesh_spec, forward_prefetch=prefetch,
                    label=str(data.get("label") or ""), tp=tp, pipeline=pipeline,
                    offload=offload)
    check_plan_fields(spec, model, train, source=source)  # See [Note: one plan check] in plan/check.py
    return PlanFields(
        spec=spec,
        model=model,
        prediction=dict(data.get("prediction") or {}),
        fabric=dict(data.get("fabric") or {}),
        baselines=dict(data.get("baselines") or {}),
        mixed_precision=mp,
        created=str(data.get("created", "")),
        wrapopt_version=str(data.get("wrapopt_version", "")),
        assumptions=Assumptions.from_json(data["assumptions"]) if data.get("assumptions") else None,
        train=train,
    )


def _int(d: dict, key: str, source: str, prefix: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise PlanError(f"{source}: field {prefix + key!r} must be a positive int, got {v!r}")
    return v


def _field_error(source: str, fld: str, msg: str) -> PlanError:
    """The error for a bad field of the plan file ``source``."""
    return PlanError(f"{source}: field {fld!r} {msg}")


def _check_format(data: dict[str, Any], source: str) -> None:
    """The ``format`` field names a plan file this wrapopt reads."""
    fmt = data.get("format")
    if not isinstance(fmt, str) or not fmt.startswith("wrapopt.plan/"):
        raise _field_error(source, "format", f"is {fmt!r}; expected {PLAN_FORMAT!r} (is this a wrapopt plan file?)")
    try:
        version = int(fmt.split("/", 1)[1])
    except ValueError:
        raise _field_error(source, "format", f"has an unreadable version: {fmt!r}") from None
    if version > _FORMAT_VERSION:
        raise _field_error(source, "format", f"is {fmt!r}, newer than this wrapopt ({__version__}) reads "
                                             f"({PLAN_FORMAT}); upgrade wrapopt")


def _mesh_from_json(mesh: Any, source: str) -> MeshSpec:
    """The plan's ``mesh`` object as a ``MeshSpec``."""
    if not isinstance(mesh, dict):
        raise _field_error(source, "mesh", "must be an object with world_size, ranks_per_node, shard_size")
    try:
        mesh_spec = MeshSpec(
            world_size=_int(mesh, "world_size", source, "mesh."),
            ranks_per_node=_int(mesh, "ranks_per_node", source, "mesh."),
            shard_size=_int(mesh, "shard_size", source, "mesh."),
            tp_size=_int(mesh, "tp_size", source, "mesh.") if "tp_size" in mesh else 1,
            pp_size=_int(mesh, "pp_size", source, "mesh.") if "pp_size" in mesh else 1,
            cp_size=_int(mesh, "cp_size", source, "mesh.") if "cp_size" in mesh else 1,
            ep_size=_int(mesh, "ep_size", source, "mesh.") if "ep_size" in mesh else 1,
        )
    except ValueError as e:
        if isinstance(e, PlanError):
            raise
        raise _field_error(source, "mesh", str(e)) from None
    return mesh_spec


def _tp_from_json(value: Any, mesh_spec: MeshSpec, source: str) -> TPSpec | None:
    """The plan's tensor-parallel plan: present exactly when ``mesh.tp_size > 1``."""
    if mesh_spec.tp_size > 1 and value is None:
        raise _field_error(source, "tp", f"is missing: a plan with mesh.tp_size {mesh_spec.tp_size} needs its "
                                         "tensor-parallel plan ({\"layers\": {block class: {submodule path: "
                                         "\"colwise\" | \"rowwise\"}}})")
    if mesh_spec.tp_size == 1 and value is not None:
        raise _field_error(source, "tp", "is set but mesh.tp_size is 1; set mesh.tp_size to the tensor-parallel "
                                         "degree, or drop tp")
    return tp_from_json(value, source=source) if mesh_spec.tp_size > 1 else None


def _pipeline_from_json(pipe: Any, mesh_spec: MeshSpec, source: str) -> PipelineSpec | None:
    """The plan's pipeline stages and schedule: present exactly when ``mesh.pp_size > 1``."""
    if (pipe is None) == (mesh_spec.pp_size > 1):
        raise _field_error(source, "pipeline", f"is missing: a plan with mesh.pp_size {mesh_spec.pp_size} needs its "
                                               "stages ({\"schedule\", \"microbatches\", \"stages\": [[module, ...], "
                                               "...]})" if pipe is None else
                           "is set but mesh.pp_size is 1; set mesh.pp_size to the pipeline degree, or drop pipeline")
    if pipe is None:
        return None
    if not isinstance(pipe, dict):
        raise _field_error(source, "pipeline", "must be an object with schedule, microbatches and stages")
    stages = pipe.get("stages")
    if (not isinstance(stages, list) or not all(isinstance(s, list) and all(isinstance(m, str) for m in s)
                                                  for s in stages)):
        raise _field_error(source, "pipeline.stages", "must be a list of stages, each a list of module names")
    try:
        out = PipelineSpec(stages=tuple(tuple(s) for s in stages), schedule=pipe.get("schedule", "1F1B"),
                           microbatches=_int(pipe, "microbatches", source, "pipeline."))
    except ValueError as e:
        if isinstance(e, PlanError):
            raise
        raise _field_error(source, "pipeline", str(e)) from None
    if len(out.stages) % mesh_spec.pp_size:
        raise _field_error(source, "pipeline.stages", f"has {len(out.stages)} stages, not a multiple of "
                                                      f"mesh.pp_size {mesh_spec.pp_size}")
    return out


def _units_from_json(units_raw: Any, source: str) -> list[UnitSpec]:
    """The plan's ``units``, root last."""
    if not isinstance(units_raw, list) or not units_raw:
        raise _field_error(source, "units", "must be a non-empty list of {modules, reshard_after_forward, checkpoint}")
    units = []
    for i, u in enumerate(units_raw):
        where = f"units[{i}]"
        if not isinstance(u, dict):
            raise _field_error(source, where, "must be an object")
        mods = u.get("modules")
        if not isinstance(mods, list) or not mods or not all(isinstance(m, str) for m in mods):
            raise _field_error(source, f"{where}.modules", "must be a non-empty list of module names")
        raf = u.get("reshard_after_forward", True)
        if not isinstance(raf, (bool, int)) or (not isinstance(raf, bool) and raf < 1):
            raise _field_error(source, f"{where}.reshard_after_forward",
                               f"must be true, false or a positive int, got {raf!r}")
        ck = u.get("checkpoint", False)
        if not isinstance(ck, bool) and ck != SELECTIVE_OP:
            raise _field_error(source, f"{where}.checkpoint",
                               f"must be true, false or {SELECTIVE_OP!r} (selective checkpointing), got {ck!r}")
        units.append(UnitSpec(tuple(mods), raf, ck))
    if units[-1].modules != (ROOT,):
        raise _field_error(source, "units", "must end with the root unit (modules [\"\"])")
    return units
