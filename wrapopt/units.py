"""Which unit owns which module, and whether a plan is legal.

Shared by the cost model, the search, the plan file and apply, so that all of
them agree on one rule:

[Note: unit ownership] ``fully_shard`` runs bottom-up and a unit manages the
parameters of its modules that no nested unit already manages (FSDP2's
``_get_managed_states``). So each module belongs to the innermost unit whose
module list contains it or one of its ancestors; the root unit (the model
itself) catches everything else.
"""

from __future__ import annotations

from functools import lru_cache

from wrapopt.errors import PlanError
from wrapopt.spec import ROOT, ModelGraph, PlanSpec, UnitSpec

__all__ = ["ancestors", "owner_index", "validate_plan", "unit_param_bytes"]


@lru_cache(maxsize=65536)
def ancestors(fqn: str) -> tuple[str, ...]:
    """``fqn`` and its ancestors, innermost first, ending with the root."""
    if fqn == ROOT:
        return (ROOT,)
    parts = fqn.split(".")
    return tuple(".".join(parts[:i]) for i in range(len(parts), 0, -1)) + (ROOT,)


def owner_index(units: tuple[UnitSpec, ...]) -> dict[str, int]:
    """Map each unit module FQN to its unit's index."""
    out: dict[str, int] = {}
    for i, u in enumerate(units):
        for m in u.modules:
            out[m] = i
    return out


def owner_of(fqn: str, index: dict[str, int]) -> int:
    for a in ancestors(fqn):
        i = index.get(a)
        if i is not None:
            return i
    raise AssertionError("the root unit owns every module")  # internal invariant


def validate_plan(graph: ModelGraph, plan: PlanSpec) -> None:
    """Raise ``PlanError`` naming what is wrong; return None for a legal plan.

    Legal: the root unit comes last; every named module exists; no module is
    listed twice (every parameter in exactly one unit); a unit's modules are
    not nested in one another; tied parameters end up in one unit.
    """
    units = plan.units
    if not units or not units[-1].is_root:
        raise PlanError("the last unit of a plan must be the root (modules [\"\"]); fully_shard(model) comes last")
    seen: dict[str, int] = {}
    unknown = []
    for i, u in enumerate(units):
        if not u.modules:
            raise PlanError(f"unit {i} has no modules")
        if u.is_root and i != len(units) - 1:
            raise PlanError("the root module appears in a unit other than the last")
        for m in u.modules:
            if m not in graph.tree:
                unknown.append(m)
            if m in seen:
                raise PlanError(f"module {m!r} is in units {seen[m]} and {i}; each module may be wrapped once")
            seen[m] = i
        for m in u.modules:
            nested = [o for o in u.modules if o != m and o.startswith(m + ".")]
            if nested and not u.is_root:
                raise PlanError(f"unit {u.name!r} lists {m!r} and its descendant {nested[0]!r}; list only the outer one")
        if isinstance(u.reshard_after_forward, int) and not isinstance(u.reshard_after_forward, bool):
            n = u.reshard_after_forward
            if n < 1 or plan.mesh.shard_size % n:
                raise PlanError(
                    f"unit {u.name!r}: reshard_after_forward={n} must divide the shard group of {plan.mesh.shard_size} ranks"
                )
    if unknown:
        raise PlanError(f"the plan names modules the model does not have: {', '.join(sorted(unknown)[:8])}")
    index = owner_index(units)
    for group in graph.tied_groups:
        owners = {}
        for pname in group:
            mod = pname.rsplit(".", 1)[0] if "." in pname else ROOT
            owners[pname] = owner_of(mod, index)
        if len(set(owners.values())) > 1:
            where = ", ".join(f"{p} -> {units[i].name}" for p, i in owners.items())
            raise PlanError(
                f"tied parameters {', '.join(group)} would land in different units ({where}); "
                "put their modules in one unit, e.g. fully_shard([module_a, module_b]), or leave them to a common parent"
            )


def unit_param_bytes(graph: ModelGraph, units: tuple[UnitSpec, ...]) -> list[int]:
    """Unsharded parameter bytes (storage dtype) owned by each unit."""
    index = owner_index(units)
    out = [0] * len(units)
    for m in graph.modules:
        if m.own_bytes:
            out[owner_of(m.fqn, index)] += m.own_bytes
    return out
