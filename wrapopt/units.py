"""Which unit owns which module, and whether a plan is legal.

Shared by the cost model, the search, the plan file and apply, so that all of
them agree on one rule:

[Note: unit ownership] ``fully_shard`` runs bottom-up and a unit manages the
parameters of its modules that no nested unit already manages (FSDP2's
``_get_managed_states``). So each module belongs to the innermost unit whose
module list contains it or one of its ancestors; the root unit (the model
itself) catches everything else.

[Note: parameter users] FSDP2 gathers a unit's parameters when the forward
of one of its modules starts (and in backward when its gradients arrive),
not when some other module reads them. A module whose parameters another
module's forward reads (``ModelGraph.param_users``: ``nn.MultiheadAttention``
reads its ``out_proj``'s weight and ``out_proj`` itself never runs) therefore
belongs to its user's unit: owner(module) == owner(user), like tied
parameters. Made a unit of its own, or put in another unit than its user, the
user reads a sharded parameter and the first forward fails with
``aten.addmm.default got mixed torch.Tensor and DTensor``. ``validate_plan``
and ``apply_plan`` refuse such plans; the search never proposes them
(``together_groups`` feeds its tie rules); the cost model charges the
parameters to the user's unit (it is the same unit) and their gradients to
the user's backward.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from functools import lru_cache

from wrapopt.errors import PlanError
from wrapopt.spec import ROOT, ModelGraph, PlanSpec, UnitSpec

__all__ = ["ancestors", "owner_index", "owner_by_ancestors", "validate_plan", "check_units", "unit_param_bytes",
           "user_conflicts", "user_conflict_message", "together_groups"]


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


def owner_by_ancestors(index: dict[str, int], n: int) -> Callable[[tuple[str, ...]], int]:
    """The owner of a module given its ancestors (innermost first): the first that is a
    unit in ``index``, else the root (the last of ``n`` units)."""

    def owner(anc: tuple[str, ...]) -> int:
        for a in anc:
            i = index.get(a)
            if i is not None:
                return i
        return n - 1

    return owner


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
    not nested in one another; tied parameters end up in one unit; a module
    shares its unit with the modules reading its parameters ([Note: parameter users]).
    """
    check_units(plan, graph.tree, graph.tied_groups)
    conflicts = user_conflicts(graph.param_users, plan.units)
    if conflicts:
        never_ran = graph.info(conflicts[0][0]).order < 0
        raise PlanError(user_conflict_message(conflicts[0], plan.units, never_ran=never_ran))


def check_units(plan: PlanSpec, modules: Container[str], tied_groups: Iterable[Iterable[str]]) -> None:
    """``validate_plan`` but for the parameter users, from what a model alone gives (the
    module names of ``named_modules()``, the groups of tied parameter names): ``apply_plan``
    runs it before any ``fully_shard``, so a plan is refused on apply as on estimate."""
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
            if m not in modules:
                unknown.append(m)
            if m in seen:
                raise PlanError(f"module {m!r} is in units {seen[m]} and {i}; each module may be wrapped once")
            seen[m] = i
        for m in u.modules:
            nested = [o for o in u.modules if o != m and o.startswith(m + ".")]
            if nested and not u.is_root:
                raise PlanError(f"unit {u.name!r} lists {m!r} and its descendant {nested[0]!r}; "
                                "list only the outer one")
        if isinstance(u.reshard_after_forward, int) and not isinstance(u.reshard_after_forward, bool):
            n = u.reshard_after_forward
            if n < 1 or plan.mesh.shard_size % n:
                raise PlanError(
                    f"unit {u.name!r}: reshard_after_forward={n} must divide the shard group of "
                    f"{plan.mesh.shard_size} ranks"
                )
    if unknown:
        raise PlanError(f"the plan names modules the model does not have: {', '.join(sorted(unknown)[:8])}")
    index = owner_index(units)
    for group in tied_groups:
        group = tuple(group)
        owners = {}
        for pname in group:
            mod = pname.rsplit(".", 1)[0] if "." in pname else ROOT
            owners[pname] = owner_of(mod, index)
        if len(set(owners.values())) > 1:
            where = ", ".join(f"{p} -> {units[i].name}" for p, i in owners.items())
            raise PlanError(
                f"tied parameters {', '.join(group)} would land in different units ({where}); "
                "put their modules in one unit, e.g. fully_shard([module_a, module_b]), or leave them to a "
                "common parent"
            )


def user_conflicts(param_users: Iterable[tuple[str, str]],
                   units: tuple[UnitSpec, ...]) -> list[tuple[str, str, int, int]]:
    """(module, user, module's unit, user's unit) for every pair of ``param_users``
    the units put apart; see [Note: parameter users]."""
    index = owner_index(units)
    out = []
    for module, user in param_users:
        i, j = owner_of(module, index), owner_of(user, index)
        if i != j:
            out.append((module, user, i, j))
    return out


def user_conflict_message(conflict: tuple[str, str, int, int], units: tuple[UnitSpec, ...], *,
                          never_ran: bool | None = None) -> str:
    """One line naming the module, its user, the units they land in and what to do."""
    module, user, i, j = conflict
    who = f"module {user!r}" if user != ROOT else "the root module's own forward"
    ran = " (its own forward never runs)" if never_ran else ""
    hints = [f"drop the unit {module!r}"] if units[i].modules == (module,) else []
    if user != ROOT:
        hints.append(f"make one unit of both, fully_shard([{module!r}, {user!r}]), or wrap a module that holds both")
    else:
        hints.append(f"leave {module!r} and the modules above it out of every unit but the root")
    return (f"module {module!r} owns parameters that {who} reads{ran}, but the plan puts {module!r} in unit "
            f"{units[i].name!r} and {user!r} in unit {units[j].name!r}: FSDP2 gathers parameters only for their own "
            f"unit, so the first forward would mix sharded and unsharded tensors. Put {module!r} in the same unit "
            f"as {user!r}: {'; or '.join(hints)}.")


def together_groups(graph: ModelGraph) -> tuple[tuple[str, ...], ...]:
    """Groups of modules that must share one unit: the modules of each tied parameter
    and each module with the modules that read its parameters, merged where they share
    a module; in order of first appearance."""
    groups = [tuple(dict.fromkeys(_module_of(p) for p in g)) for g in graph.tied_groups]
    groups += [pair for pair in graph.param_users]
    merged: list[list[str]] = []
    for g in groups:
        hit = [m for m in merged if any(x in m for x in g)]
        if not hit:
            merged.append(list(dict.fromkeys(g)))
            continue
        first = hit[0]
        for other in hit[1:]:
            first.extend(x for x in other if x not in first)
            merged = [m for m in merged if m is not other]
        first.extend(x for x in g if x not in first)
    return tuple(tuple(m) for m in merged)


def _module_of(pname: str) -> str:
    return pname.rsplit(".", 1)[0] if "." in pname else ROOT


def unit_param_bytes(graph: ModelGraph, units: tuple[UnitSpec, ...]) -> list[int]:
    """Unsharded parameter bytes (storage dtype) owned by each unit."""
    index = owner_index(units)
    out = [0] * len(units)
    for m in graph.modules:
        if m.own_bytes:
            out[owner_of(m.fqn, index)] += m.own_bytes
    return out
