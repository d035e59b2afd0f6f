"""The plans people pick by hand, always scored beside wrapopt's answer.

- ``per-block``: one unit per transformer block (Accelerate's
  ``transformer_auto_wrap_policy``, TorchTitan's per-layer ``fully_shard``).
- ``per-block,ckpt``: the same with every block checkpointed (full activation
  checkpointing): what most people run on a large model (TorchTitan's Llama
  configs, Accelerate's ``activation_checkpointing``).
- ``size-1e8``: FSDP1's ``size_based_auto_wrap_policy`` at its 1e8 default,
  replayed exactly (``_recursive_wrap``): wrap a module when the parameters
  not already wrapped below it reach the threshold; ModuleList/ModuleDict are
  never wrapped.
- ``every-leaf``: every leaf module that owns parameters.
- ``root-only``: one unit, the whole model.
- ``no-shard``: no sharding at all (DDP-like); shown because on a slow fabric
  FSDP can lose to plain replication when memory allows.

A baseline that would split tied parameters leaves the offending modules to
their common parent instead (FSDP2 cannot shard one parameter in two units);
the same for a module and the module that reads its parameters
(``nn.MultiheadAttention.out_proj`` in every-leaf; [Note: parameter users]).

Three search strategies come from them (see [Note: search strategies]):
``Baselines`` (the plans above, the reference points of every search),
``SmallestMemory`` (the finest of them, every unit resharded and
checkpointed: the smallest peaks, for the message when nothing fits) and
``BaselinesOnShardGroups`` (the sharded ones again on each other shard group
of the search: HSDP, cheap, and sometimes the answer).
"""

from __future__ import annotations

from dataclasses import replace

from wrapopt.choices import BASELINE_NAMES
from wrapopt.errors import PlanError
from wrapopt.search.strategy import History, Proposal, SearchProblem, Strategy
from wrapopt.spec import ROOT, SELECTIVE_OP, MeshSpec, ModelGraph, PlanSpec, UnitSpec
from wrapopt.units import together_groups, validate_plan

__all__ = ["baselines", "make_plan", "checkpointed", "BASELINE_NAMES", "Baselines", "SmallestMemory",
           "BaselinesOnShardGroups"]

_NEVER_WRAP = ("ModuleList", "ModuleDict")


def make_plan(
    graph: ModelGraph,
    mesh: MeshSpec,
    modules: list[tuple[str, ...]] | list[str],
    *,
    label: str = "",
    reshard_after_forward: bool | int = True,
    checkpoint: bool | str = False,
    forward_prefetch: int = 0,
) -> PlanSpec:
    """A plan from unit module lists (innermost first is not required: they are
    ordered bottom-up here), with the root appended."""
    groups = [(m,) if isinstance(m, str) else tuple(m) for m in modules]
    groups = [g for g in groups if g != (ROOT,)]
    # Bottom-up: deeper units first, then by forward order.
    groups.sort(key=lambda g: (-min(graph.info(m).depth for m in g), min(graph.info(m).order for m in g)))
    # The root keeps its parameters from forward to backward, as FSDP2 does by default.
    units = tuple(UnitSpec(g, reshard_after_forward, checkpoint) for g in groups) + (UnitSpec((ROOT,), False),)
    return PlanSpec(units=units, mesh=mesh, forward_prefetch=forward_prefetch, label=label)


def _drop_tie_splits(graph: ModelGraph, mesh: MeshSpec, modules: list[str], label: str) -> PlanSpec:
    tied_modules = {m for g in together_groups(graph) for m in g}
    kept = []
    for m in modules:
        prefix = m + "."
        holds_tied = any(t == m or t.startswith(prefix) for t in tied_modules)
        kept.append((m, holds_tied))
    plan = make_plan(graph, mesh, [m for m, _ in kept], label=label)
    try:
        validate_plan(graph, plan)
        return plan
    except PlanError:
        return make_plan(graph, mesh, [m for m, tied in kept if not tied], label=label)


def _size_based(graph: ModelGraph, min_num_params: int) -> list[str]:
    wrapped: list[str] = []

    def rec(fqn: str, only_children: bool) -> int:
        info = graph.info(fqn)
        if info.total_numel < min_num_params:  # policy(recurse=True)
            return 0
        total_wrapped = sum(rec(c, False) for c in info.children)
        remainder = info.total_numel - total_wrapped
        if not only_children and remainder >= min_num_params and info.cls not in _NEVER_WRAP:
            wrapped.append(fqn)
            return info.total_numel
        return total_wrapped

    rec(ROOT, True)
    return wrapped


def baselines(graph: ModelGraph, mesh: MeshSpec) -> dict[str, PlanSpec]:
    """The named baseline plans for ``graph`` on ``mesh`` (``per-block`` only if
    the model has a block chain)."""
    out: dict[str, PlanSpec] = {}
    if graph.blocks:
        per_block = _drop_tie_splits(graph, mesh, list(graph.blocks), "per-block")
        out["per-block"] = per_block
        out["per-block,ckpt"] = checkpointed(per_block, "per-block,ckpt")
    out["size-1e8"] = _drop_tie_splits(graph, mesh, _size_based(graph, int(1e8)), "size-1e8")
    leaves = [m.fqn for m in graph.modules if not m.children and m.own_numel and m.fqn != ROOT]
    out["every-leaf"] = _drop_tie_splits(graph, mesh, leaves, "every-leaf")
    out["root-only"] = make_plan(graph, mesh, [], label="root-only")
    # No sharding = a shard group of one rank: FSDP2 on a (world, 1) mesh replicates.
    replicate = MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=1)
    out["no-shard"] = make_plan(graph, replicate, [], label="no-shard")
    return out


def with_choices(plan: PlanSpec, *, reshard: bool | int = True, checkpoint: bool | str = False,
                 label: str | None = None) -> PlanSpec:
    """``plan`` with every unit but the root given one reshard and one checkpoint choice."""
    units = tuple(u if u.is_root else UnitSpec(u.modules, reshard, checkpoint) for u in plan.units)
    return replace(plan, units=units, label=plan.label if label is None else label)


def checkpointed(plan: PlanSpec, label: str, mode: bool | str = True) -> PlanSpec:
    """``plan`` with every unit but the root resharded after forward and checkpointed (``mode``:
    True, full; SELECTIVE_OP, selective-op)."""
    return with_choices(plan, checkpoint=mode, label=label)


def smallest_plan(graph: ModelGraph, mesh: MeshSpec) -> PlanSpec:
    """The plan of least memory among the baselines: one unit per block (every leaf without
    blocks), each resharded and checkpointed."""
    base = baselines(graph, mesh)
    name = "per-block" if "per-block" in base else "every-leaf"
    return checkpointed(base[name], f"{name},ckpt")


class Baselines(Strategy):
    """The named baselines on the mesh asked for: scored in every search, shown beside its answer."""

    name = "baselines"
    reference = True
    seed_every_plan = True

    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        base = baselines(problem.graph, problem.mesh)
        plans = tuple(base.values())
        if SELECTIVE_OP in problem.options.checkpoint_modes and "per-block" in base:
            plans += (checkpointed(base["per-block"], "per-block,sac", SELECTIVE_OP),)
        return Proposal(plans=plans)


class SmallestMemory(Strategy):
    """The baselines with the smallest units, every unit resharded and checkpointed."""

    name = "smallest-memory"

    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        base = baselines(problem.graph, problem.mesh)
        out = [checkpointed(base[name], f"{name},ckpt") for name in ("per-block", "every-leaf") if name in base]
        return Proposal(plans=tuple(out))


class BaselinesOnShardGroups(Strategy):
    """The baselines that shard over the mesh's group (all but ``no-shard``), again on
    each other shard group of the search (HSDP)."""

    name = "baselines-on-shard-groups"

    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        mesh = problem.mesh
        base = baselines(problem.graph, mesh)
        out = []
        for s in problem.shard_sizes:
            if s != mesh.shard_size:
                m = MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=s)
                out += [replace(p, mesh=m, label=f"{name},shard={s}") for name, p in base.items() if p.mesh == mesh]
        return Proposal(plans=tuple(out))
