"""WrapPlan: the plan file (versioned JSON) and its exports.

The file is read with ``json`` only: nothing in it is unpickled or evaluated.
Every load error names the file and the field; loading a plan for another
model names the parameters that differ.

Example:
    >>> plan = WrapPlan.load("results/demo/plan.json")  # doctest: +SKIP
    >>> model = plan.apply(model)  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from wrapopt.errors import PlanError, PlanMismatchError
from wrapopt.types import ROOT, CostEstimate, MeshSpec, PlanSpec, UnitSpec

__all__ = ["WrapPlan", "PLAN_FORMAT", "model_fingerprint"]

PLAN_FORMAT = "wrapopt.plan/1"
_FORMAT_VERSION = 1


def _version() -> str:
    from wrapopt import __version__

    return __version__


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Class, parameter count, and a hash of the sorted (name, shape, dtype) of
    every parameter (tied parameters under their first name)."""
    params = {n: (list(p.shape), str(p.dtype).replace("torch.", "")) for n, p in model.named_parameters()}
    text = json.dumps(sorted(params.items()))
    return {
        "class": type(model).__name__,
        "num_params": sum(p.numel() for p in model.parameters()),
        "hash": hashlib.sha256(text.encode()).hexdigest()[:16],
        "params": {n: {"shape": s, "dtype": d} for n, (s, d) in sorted(params.items())},
    }


@dataclass
class WrapPlan:
    """A wrapping plan with everything needed to apply and to judge it.

    ``spec`` is what ``fully_shard`` needs; the rest is provenance: the model
    it was made for, the prediction, the fabric it was scored on, and the
    baselines' predictions on the same fabric.
    """

    spec: PlanSpec
    model: dict[str, Any]  # model_fingerprint(...)
    prediction: dict[str, Any] = field(default_factory=dict)
    fabric: dict[str, Any] = field(default_factory=dict)
    baselines: dict[str, Any] = field(default_factory=dict)
    mixed_precision: dict[str, str | None] = field(default_factory=lambda: {"param_dtype": None, "reduce_dtype": None})
    created: str = ""
    wrapopt_version: str = ""

    @property
    def units(self) -> tuple[UnitSpec, ...]:
        return self.spec.units

    @property
    def mesh(self) -> MeshSpec:
        return self.spec.mesh

    @classmethod
    def from_search(
        cls,
        spec: PlanSpec,
        model: nn.Module,
        estimate: CostEstimate,
        *,
        fabric: dict[str, Any],
        baselines: dict[str, Any],
        mixed_precision: dict[str, str | None] | None = None,
    ) -> "WrapPlan":
        return cls(
            spec=spec,
            model=model_fingerprint(model),
            prediction=estimate.to_json(),
            fabric=fabric,
            baselines=baselines,
            mixed_precision=mixed_precision or {"param_dtype": None, "reduce_dtype": None},
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            wrapopt_version=_version(),
        )

    # -- file format ----------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "wrapopt_version": self.wrapopt_version or _version(),
            "created": self.created,
            "label": self.spec.label,
            "model": self.model,
            "mesh": self.spec.mesh.to_json(),
            "units": [
                {"modules": list(u.modules), "reshard_after_forward": u.reshard_after_forward, "checkpoint": u.checkpoint}
                for u in self.spec.units
            ],
            "forward_prefetch": self.spec.forward_prefetch,
            "mixed_precision": self.mixed_precision,
            "prediction": self.prediction,
            "fabric": self.fabric,
            "baselines": self.baselines,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan atomically as JSON."""
        from wrapopt._io import atomic_write_json

        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "WrapPlan":
        """Read and validate a plan file; errors name the file and the field."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise PlanError(f"{path}: no such plan file; make one with `wrapopt search MODEL --out {path}`") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"{path}: not a JSON plan file ({e})") from None
        return cls.from_json(data, source=path)

    @classmethod
    def from_json(cls, data: Any, *, source: str = "<plan>") -> "WrapPlan":
        def fail(fld: str, msg: str) -> PlanError:
            return PlanError(f"{source}: field {fld!r} {msg}")

        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan file is a JSON object, got {type(data).__name__}")
        fmt = data.get("format")
        if not isinstance(fmt, str) or not fmt.startswith("wrapopt.plan/"):
            raise fail("format", f"is {fmt!r}; expected {PLAN_FORMAT!r} (is this a wrapopt plan file?)")
        try:
            version = int(fmt.split("/", 1)[1])
        except ValueError:
            raise fail("format", f"has an unreadable version: {fmt!r}") from None
        if version > _FORMAT_VERSION:
            raise fail("format", f"is {fmt!r}, newer than this wrapopt ({_version()}) reads ({PLAN_FORMAT}); upgrade wrapopt")
        model = data.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("params"), dict) or not isinstance(model.get("class"), str):
            raise fail("model", "must be an object with 'class' and 'params' (the model fingerprint)")
        mesh = data.get("mesh")
        if not isinstance(mesh, dict):
            raise fail("mesh", "must be an object with world_size, ranks_per_node, shard_size")
        try:
            mesh_spec = MeshSpec(
                world_size=_int(mesh, "world_size", source, "mesh."),
                ranks_per_node=_int(mesh, "ranks_per_node", source, "mesh."),
                shard_size=_int(mesh, "shard_size", source, "mesh."),
            )
        except ValueError as e:
            if isinstance(e, PlanError):
                raise
            raise fail("mesh", str(e)) from None
        units_raw = data.get("units")
        if not isinstance(units_raw, list) or not units_raw:
            raise fail("units", "must be a non-empty list of {modules, reshard_after_forward, checkpoint}")
        units = []
        for i, u in enumerate(units_raw):
            where = f"units[{i}]"
            if not isinstance(u, dict):
                raise fail(where, "must be an object")
            mods = u.get("modules")
            if not isinstance(mods, list) or not mods or not all(isinstance(m, str) for m in mods):
                raise fail(f"{where}.modules", "must be a non-empty list of module names")
            raf = u.get("reshard_after_forward", True)
            if not isinstance(raf, (bool, int)) or (not isinstance(raf, bool) and raf < 1):
                raise fail(f"{where}.reshard_after_forward", f"must be true, false or a positive int, got {raf!r}")
            ck = u.get("checkpoint", False)
            if not isinstance(ck, bool):
                raise fail(f"{where}.checkpoint", f"must be true or false, got {ck!r}")
            units.append(UnitSpec(tuple(mods), raf, ck))
        if units[-1].modules != (ROOT,):
            raise fail("units", "must end with the root unit (modules [\"\"])")
        prefetch = data.get("forward_prefetch", 0)
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise fail("forward_prefetch", f"must be a non-negative int, got {prefetch!r}")
        mp = data.get("mixed_precision") or {"param_dtype": None, "reduce_dtype": None}
        if not isinstance(mp, dict) or any(v not in (None, "float32", "bfloat16", "float16") for v in mp.values()):
            raise fail("mixed_precision", "must map param_dtype/reduce_dtype to null, 'float32', 'bfloat16' or 'float16'")
        for fld in ("prediction", "fabric", "baselines"):
            v = data.get(fld)
            if v is not None and not isinstance(v, dict):
                raise fail(fld, "must be an object")
        spec = PlanSpec(units=tuple(units), mesh=mesh_spec, forward_prefetch=prefetch, label=str(data.get("label") or ""))
        return cls(
            spec=spec,
            model=model,
            prediction=dict(data.get("prediction") or {}),
            fabric=dict(data.get("fabric") or {}),
            baselines=dict(data.get("baselines") or {}),
            mixed_precision=mp,
            created=str(data.get("created", "")),
            wrapopt_version=str(data.get("wrapopt_version", "")),
        )

    # -- checking and applying --------------------------------------------------------

    def check_model(self, model: nn.Module) -> None:
        """Raise ``PlanMismatchError`` naming what differs if ``model`` is not the planned model."""
        mine = self.model.get("params", {})
        theirs = model_fingerprint(model)["params"]
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        changed = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
        unknown = sorted({m for u in self.units for m in u.modules} - {n for n, _ in model.named_modules()})
        if missing or extra or changed or unknown:
            parts = []
            if unknown:
                parts.append(f"modules in the plan but not in the model: {', '.join(unknown[:6])}")
            if missing:
                parts.append(f"parameters only in the plan: {', '.join(missing[:6])}")
            if extra:
                parts.append(f"parameters only in the model: {', '.join(extra[:6])}")
            if changed:
                parts.append("parameters whose shape or dtype differ: " + ", ".join(
                    f"{n} {mine[n]['shape']}->{theirs[n]['shape']}" for n in changed[:6]))
            raise PlanMismatchError(
                f"this plan was made for {self.model.get('class')} with {self.model.get('num_params')} parameters, "
                f"not for this {type(model).__name__}; " + "; ".join(parts)
                + ". Re-run the search for this model, or pass strict=False to apply by module names only."
            )

    def apply(self, model: nn.Module, mesh: Any = None, *, strict: bool = True) -> nn.Module:
        """Shard ``model`` in place with FSDP2 following this plan and return it.

        ``mesh`` is a ``DeviceMesh``; by default one is built from the plan's
        mesh on the current process group. ``strict=False`` skips the
        fingerprint check (the module names must still exist).
        """
        from wrapopt.apply import apply_plan

        if strict:
            self.check_model(model)
        return apply_plan(model, self.spec, mesh=mesh, mixed_precision=self.mixed_precision)

    def to_fsdp1_policy(self):
        """An ``auto_wrap_policy`` for FSDP1 that wraps exactly this plan's units.

        FSDP1 wraps single modules only; a unit that groups several modules
        has no FSDP1 equivalent and raises ``PlanError`` saying which.
        """
        grouped = [u.name for u in self.units if len(u.modules) > 1]
        if grouped:
            raise PlanError(
                f"FSDP1 cannot wrap a group of modules as one unit ({', '.join(grouped[:4])}); "
                "use plan.apply() (FSDP2) or search with single-module units"
            )
        return _PlanPolicy(frozenset(u.modules[0] for u in self.units if not u.is_root))


class _PlanPolicy:
    """FSDP1 ``auto_wrap_policy`` wrapping the modules named in a plan.

    FSDP1 hands the policy module objects, not names; its first call is on
    the root, so the names are resolved against that root then.
    """

    def __init__(self, names: frozenset[str]):
        self.names = names
        self._ids: set[int] | None = None

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if self._ids is None:  # the root: resolve the plan's names
            found = {n: m for n, m in module.named_modules() if n in self.names}
            missing = sorted(self.names - set(found))
            if missing:
                raise PlanError(f"the plan names modules this model does not have: {', '.join(missing[:6])}")
            self._ids = {id(m) for m in found.values()}
        return True if recurse else id(module) in self._ids


def _int(d: dict, key: str, source: str, prefix: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise PlanError(f"{source}: field {prefix + key!r} must be a positive int, got {v!r}")
    return v
