"""Search: the fastest plan under a memory budget, with the baselines beside it.

``search_plan`` gathers candidates (the baselines, the DP answer for each
uniform choice, and uniform groupings), scores each with the event simulator
and keeps the fastest whose predicted peak fits the budget. The DP's
chain-model optimum is always among the candidates; the simulator has the
last word (see [Note: chain model] in ``dp.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from wrapopt._io import fmt_bytes
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.search.baselines import BASELINE_NAMES, baselines, make_plan
from wrapopt.search.dp import dp_plans
from wrapopt.types import CostEstimate, MeshSpec, ModelGraph, PlanSpec, UnitSpec
from wrapopt.units import validate_plan

__all__ = ["SearchResult", "Scored", "search_plan", "baselines", "make_plan", "BASELINE_NAMES"]


@dataclass(frozen=True, slots=True)
class Scored:
    plan: PlanSpec
    estimate: CostEstimate
    fits: bool


@dataclass(frozen=True)
class SearchResult:
    best: Scored
    baselines: dict[str, Scored]
    candidates: tuple[Scored, ...] = field(repr=False)
    memory_budget: float
    notes: tuple[str, ...] = ()

    @property
    def best_baseline(self) -> Scored | None:
        fitting = [s for s in self.baselines.values() if s.fits]
        return min(fitting, key=lambda s: s.estimate.step_s) if fitting else None


def _uniform(graph: ModelGraph, mesh: MeshSpec, size: int, reshard: bool, ckpt: bool) -> PlanSpec | None:
    groups: list[tuple[str, ...]] = []
    for chain in graph.block_chains:
        for i in range(0, len(chain), size):
            groups.append(chain[i:i + size])
    if not groups:
        return None
    label = f"groups-of-{size}" + ("" if reshard else ",keep") + (",ckpt" if ckpt else "")
    units = tuple(UnitSpec(g, reshard, ckpt) for g in groups)
    base = make_plan(graph, mesh, [])
    return PlanSpec(units=units + base.units, mesh=mesh, label=label)


def search_plan(
    graph: ModelGraph,
    sim: Simulator,
    mesh: MeshSpec,
    *,
    memory_budget: float | None = None,
    max_group: int = 8,
) -> SearchResult:
    """Score the candidates and return the fastest plan that fits ``memory_budget`` bytes."""
    budget = float(memory_budget) if memory_budget else math.inf
    base_plans = baselines(graph, mesh)
    scored_base = {}
    for name, plan in base_plans.items():
        validate_plan(graph, plan)
        est = sim.simulate(plan)
        scored_base[name] = Scored(plan, est, est.peak_bytes <= budget)

    candidates: list[PlanSpec] = []
    if graph.block_chains:
        root_only = scored_base["root-only"].estimate
        # Static part of memory outside the chains' local terms (see dp.py).
        static = sum(v for k, v in root_only.peak_breakdown if k in ("sharded_params", "sharded_grads", "optimizer_state", "accumulated_grads"))
        root_units = make_plan(graph, mesh, list(graph.blocks)).units
        root_bytes = sim.simulate(PlanSpec(root_units, mesh)).units[-1].param_bytes
        for _label, plan, _t in dp_plans(sim, mesh, graph.block_chains, memory_budget=budget,
                                         static_bytes=static + root_bytes, max_group=max_group):
            candidates.append(plan)
        longest = max(len(c) for c in graph.block_chains)
        for size in sorted({1, 2, 3, 4, 6, 8, 16, longest} & set(range(1, longest + 1))):
            for reshard in (True, False):
                for ckpt in (False, True):
                    p = _uniform(graph, mesh, size, reshard, ckpt)
                    if p is not None:
                        candidates.append(p)
    scored = list(scored_base.values())
    seen = {(s.plan.units, s.plan.mesh) for s in scored}
    for plan in candidates:
        key = (plan.units, plan.mesh)
        if key in seen:
            continue
        seen.add(key)
        validate_plan(graph, plan)
        est = sim.simulate(plan)
        scored.append(Scored(plan, est, est.peak_bytes <= budget))
    fitting = [s for s in scored if s.fits]
    if not fitting:
        smallest = min(scored, key=lambda s: s.estimate.peak_bytes)
        raise InfeasibleError(
            f"no plan fits the memory budget of {fmt_bytes(budget)} per rank: the smallest predicted peak is "
            f"{fmt_bytes(smallest.estimate.peak_bytes)} ({smallest.plan.label or 'candidate'}). To fit: enable "
            "activation checkpointing, use more ranks (a larger shard group), a smaller per-rank batch, or mixed precision."
        )
    # Fastest first; among equal times the smaller peak, then fewer units.
    best = min(fitting, key=lambda s: (round(s.estimate.step_s, 12), s.estimate.peak_bytes, len(s.plan.units)))
    notes = tuple(sorted({n for s in scored for n in s.estimate.notes}))
    return SearchResult(best=best, baselines=scored_base, candidates=tuple(scored), memory_budget=budget, notes=notes)
