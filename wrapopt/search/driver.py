"""Search: the fastest plan under a memory budget, with the baselines beside it.

``search_plan`` scores, with the event simulator:

1. the baselines (``baselines.py``);
2. the exact DP answer (per-unit reshard and checkpointing over contiguous
   groupings of the block chains, ``dp.py``) on each shard-group size: FSDP
   over the world and, when the world spans nodes, HSDP with one node and
   whole nodes per shard group; plus the DP answer for each uniform choice;
3. uniform groupings and the smallest-memory plans (for the error message
   when nothing fits);
4. with ``options.trials > 0``, an Optuna study over the general space
   (``space.py``, ``optuna_search.py``) seeded with all of the above.

The fastest plan whose predicted peak fits the budget wins; the simulator has
the last word over the DP's chain model (see [Note: chain model] in ``dp.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.fileio import fmt_bytes
from wrapopt.search.baselines import baselines, make_plan
from wrapopt.search.dp.plans import ChainDP
from wrapopt.search.study.run import run_study
from wrapopt.search.study.space import SearchSpace
from wrapopt.spec import CostEstimate, MeshSpec, ModelGraph, PlanSpec, UnitSpec
from wrapopt.units import validate_plan

__all__ = ["SearchResult", "SearchOptions", "Scored", "search_plan", "dp_shard_sizes", "DEFAULT_TRIALS"]

DEFAULT_TRIALS = 200  # Optuna trials of `wrapopt search` and `plan_model` (the simulator scores ~1000/s)


@dataclass(frozen=True, slots=True)
class Scored:
    plan: PlanSpec
    estimate: CostEstimate
    fits: bool


@dataclass(kw_only=True)
class SearchOptions:
    """How ``search_plan`` searches; the CLI's ``search`` flags map onto these."""

    trials: int = 0  # Optuna trials in total (a resumed study counts its stored ones); 0: no study
    seed: int = 0  # the sampler's seed: the same seed gives the same study
    storage: str | None = None  # a path (SQLite) or an Optuna storage URL; None: in memory
    study_name: str | None = None  # default: from the model, mesh, budget and fabric
    sampler: str = "auto"  # "tpe", "nsga2", or "auto": TPE on small spaces, NSGA-II on large ones
    # Shard-group sizes to consider; None: the world, and when it spans
    # nodes one node and whole nodes (HSDP). The study also tries parts of a node.
    shard_sizes: tuple[int, ...] | None = None
    max_group: int = 8  # the DP's largest group of blocks in one unit
    timeout_s: float | None = None  # stop the study after this long (finished trials are kept)
    progress: bool = False  # a progress line on stderr

    def __post_init__(self) -> None:
        if self.trials < 0:
            raise ValueError(f"trials must be >= 0, got {self.trials}")
        if self.max_group < 1:
            raise ValueError(f"max_group must be >= 1, got {self.max_group}")
        if self.sampler not in ("auto", "tpe", "nsga2"):
            raise ValueError(f"unknown sampler {self.sampler!r}; choose auto, tpe or nsga2")
        if self.study_name is not None and not self.study_name.strip():
            raise ValueError("the study name is empty")


@dataclass(frozen=True)
class SearchResult:
    best: Scored
    baselines: dict[str, Scored]
    candidates: tuple[Scored, ...] = field(repr=False)
    memory_budget: float
    notes: tuple[str, ...] = ()
    # Fitting plans not beaten in both time and memory by another, fastest first.
    pareto: tuple[Scored, ...] = field(default=(), repr=False)
    dp_best: Scored | None = None  # the fastest fitting DP answer (as the simulator scores it)
    optuna_best: Scored | None = None  # the fastest fitting trial of the study
    study: object | None = field(default=None, repr=False)  # optuna_search.StudyOutcome

    @property
    def best_baseline(self) -> Scored | None:
        fitting = [s for s in self.baselines.values() if s.fits]
        return min(fitting, key=lambda s: s.estimate.step_s) if fitting else None


def dp_shard_sizes(mesh: MeshSpec) -> tuple[int, ...]:
    """Shard groups the DP tries: the world, and when it spans nodes one node and
    every power-of-two number of whole nodes below the world."""
    if mesh.world_size <= mesh.ranks_per_node:
        return (mesh.world_size,)
    out = {mesh.world_size}
    s = mesh.ranks_per_node
    while s < mesh.world_size:
        if mesh.world_size % s == 0:
            out.add(s)
        s *= 2
    return tuple(sorted(out, reverse=True))


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


def _min_memory_plans(graph: ModelGraph, mesh: MeshSpec, base: dict[str, PlanSpec]) -> list[PlanSpec]:
    """The baselines with the smallest units, every unit resharded and checkpointed."""
    out = []
    for name in ("per-block", "every-leaf"):
        p = base.get(name)
        if p is not None:
            units = tuple(UnitSpec(u.modules, True, True) if not u.is_root else u for u in p.units)
            out.append(replace(p, units=units, label=f"{name},ckpt"))
    return out


def _dp_candidates(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, budget: float, sizes: tuple[int, ...],
                   max_group: int) -> list[PlanSpec]:
    """DP answers per shard-group size (the uniform-choice ones on ``mesh`` only).

    Sizes are solved in the order of their lower bound under the budget; a
    size whose bound is already slower than an answer found (that the
    simulator says fits) is skipped, since its answer can only be slower
    still in the DP's model.
    """
    chains = graph.block_chains
    prefetches = (0,) if sim.compute.runs_ahead else (0, 1)
    jobs = []
    for s in sizes:
        m = MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=s)
        for pf in prefetches:
            dp = ChainDP(sim, m, chains, max_group=max_group, forward_prefetch=pf)
            if dp.static_bytes >= budget:
                break
            jobs.append((dp.lower_bound(budget), s == mesh.shard_size and pf == 0, dp))
    jobs.sort(key=lambda j: (not j[1], j[0]))  # the requested mesh first: its uniform answers always come
    plans: list[PlanSpec] = []
    best_t = math.inf
    for lb, main, dp in jobs:
        if lb >= best_t and not main:
            continue
        for answer in dp.answers(budget, uniform=main, give_up_above=math.inf if main else best_t):
            plans.append(answer.plan)
            if answer.per_unit:
                best_t = min(best_t, answer.time_s)
    return plans


def search_plan(
    graph: ModelGraph,
    sim: Simulator,
    mesh: MeshSpec,
    *,
    memory_budget: float | None = None,
    max_group: int | None = None,
    options: SearchOptions | None = None,
) -> SearchResult:
    """Score the candidates and return the fastest plan that fits ``memory_budget`` bytes.

    Without ``options`` (or with ``options.trials == 0``) no Optuna study runs:
    the answer is the best of the baselines, the DP answers and uniform
    groupings. Raises ``InfeasibleError`` with the smallest predicted peak and
    what would make it fit when no plan fits.

    Example:
        >>> from wrapopt import zoo
        >>> from wrapopt.trace import trace_model
        >>> from wrapopt.hardware import analytical_compute, analytical_fabric
        >>> model, x = zoo.build("llama-tiny", "meta")
        >>> g = trace_model(model, x)
        >>> mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
        >>> sim = Simulator(g, analytical_fabric(world_size=16), analytical_compute())
        >>> res = search_plan(g, sim, mesh, options=SearchOptions(trials=50, seed=0))
        >>> res.best.estimate.step_s <= res.best_baseline.estimate.step_s
        True
    """
    opts = options or SearchOptions()
    group = max_group or opts.max_group
    budget = float(memory_budget) if memory_budget else math.inf
    sizes = tuple(opts.shard_sizes) if opts.shard_sizes else dp_shard_sizes(mesh)
    for s in sizes:
        MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=s)  # raises if illegal
    base_plans = baselines(graph, mesh)
    scored_base = {}
    for name, plan in base_plans.items():
        validate_plan(graph, plan)
        est = sim.simulate(plan)
        scored_base[name] = Scored(plan, est, est.peak_bytes <= budget)

    candidates: list[PlanSpec] = []
    dps: list[PlanSpec] = []
    if graph.block_chains:
        dps = _dp_candidates(graph, sim, mesh, budget, sizes, group)
        candidates += dps
        longest = max(len(c) for c in graph.block_chains)
        for size in sorted({1, 2, 3, 4, 6, 8, 16, longest} & set(range(1, longest + 1))):
            for reshard in (True, False):
                for ckpt in (False, True):
                    p = _uniform(graph, mesh, size, reshard, ckpt)
                    if p is not None:
                        candidates.append(p)
    candidates += _min_memory_plans(graph, mesh, base_plans)
    for s in sizes:  # the baselines on the other shard groups (HSDP): cheap, and sometimes the answer
        if s != mesh.shard_size:
            m = MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=s)
            candidates += [replace(p, mesh=m, label=f"{name},shard={s}") for name, p in base_plans.items() if name != "no-shard"]
    scored = list(scored_base.values())
    by_key = {_key(s.plan): s for s in scored}
    for plan in candidates:
        if _key(plan) in by_key:
            continue
        validate_plan(graph, plan)
        est = sim.simulate(plan)
        by_key[_key(plan)] = Scored(plan, est, est.peak_bytes <= budget)
        scored.append(by_key[_key(plan)])
    dp_scored = [by_key[_key(p)] for p in dps]
    dp_best = _fastest([s for s in dp_scored if s.fits])

    study = None
    optuna_best = None
    if opts.trials > 0:
        space = SearchSpace(graph, mesh, shard_choices=opts.shard_sizes)
        # Seeds: the baselines, then every DP answer, then the best of the rest.
        rest = sorted((s for s in scored if s.fits), key=lambda s: s.estimate.step_s)
        seeds = [s.plan for s in scored_base.values()] + dps
        seeds += [s.plan for s in rest[:8]]
        study = run_study(graph, sim, space, memory_budget=budget, seeds=seeds, trials=opts.trials, seed=opts.seed,
                          storage=opts.storage, study_name=opts.study_name, sampler=opts.sampler,
                          timeout_s=opts.timeout_s, progress=opts.progress)
        for t in study.pareto:
            scored.append(Scored(t.plan, t.estimate, True))
        if study.best is not None:
            optuna_best = Scored(study.best.plan, study.best.estimate, True)

    fitting = [s for s in scored if s.fits]
    if not fitting:
        raise InfeasibleError(_infeasible_message(sim, mesh, budget, scored))
    best = _fastest(fitting)
    assert best is not None
    notes = tuple(sorted({n for s in scored for n in s.estimate.notes}))
    return SearchResult(best=best, baselines=scored_base, candidates=tuple(scored), memory_budget=budget,
                        notes=notes, pareto=_pareto(fitting), dp_best=dp_best, optuna_best=optuna_best,
                        study=study)


def _key(plan: PlanSpec) -> tuple:
    return (plan.units, plan.mesh, plan.forward_prefetch)


def _fastest(scored: list[Scored]) -> Scored | None:
    # Fastest first; among equal times the smaller peak, then fewer units.
    if not scored:
        return None
    return min(scored, key=lambda s: (round(s.estimate.step_s, 12), s.estimate.peak_bytes, len(s.plan.units)))


def _pareto(fitting: list[Scored]) -> tuple[Scored, ...]:
    out, best_peak = [], math.inf
    for s in sorted(fitting, key=lambda s: (s.estimate.step_s, s.estimate.peak_bytes, len(s.plan.units))):
        if s.estimate.peak_bytes < best_peak:
            out.append(s)
            best_peak = s.estimate.peak_bytes
    return tuple(out)


def _infeasible_message(sim: Simulator, mesh: MeshSpec, budget: float, scored: list[Scored]) -> str:
    """One line: the smallest peak any plan reaches, what it is made of, and what would fit."""
    smallest = min(scored, key=lambda s: s.estimate.peak_bytes)
    parts = dict(smallest.estimate.peak_breakdown)
    sharded = sum(parts.get(k, 0) for k in ("sharded_params", "sharded_grads", "optimizer_state"))
    acts = parts.get("activations", 0) + parts.get("working_set", 0)
    plan = smallest.plan
    msg = (f"no plan fits the memory budget of {fmt_bytes(budget)} per rank: the smallest predicted peak is "
           f"{fmt_bytes(smallest.estimate.peak_bytes)} ({plan.label or 'candidate'}, shard group {plan.mesh.shard_size}: "
           f"sharded state {fmt_bytes(sharded)}, activations and working set {fmt_bytes(acts)}). To fit: ")
    advice = []
    if not all(u.checkpoint for u in plan.units if not u.is_root):
        advice.append("activation checkpointing")
    if plan.mesh.shard_size < mesh.world_size:
        advice.append(f"a larger shard group (up to the world of {mesh.world_size})")
    fit_at = None
    for factor in (2, 4, 8, 16, 32, 64):
        w = mesh.world_size * factor
        bigger = MeshSpec(world_size=w, ranks_per_node=mesh.ranks_per_node, shard_size=w)
        est = sim.simulate(replace(plan, mesh=bigger))
        if est.peak_bytes <= budget:
            fit_at = (w, est.peak_bytes)
            break
    if fit_at:
        advice.append(f"more ranks: sharding over {fit_at[0]} ranks brings it to {fmt_bytes(fit_at[1])}")
    else:
        advice.append(f"more ranks alone will not do (activations and working set are {fmt_bytes(acts)})")
    advice.append("or a smaller per-rank batch or mixed precision")
    return msg + "; ".join(advice) + "."
