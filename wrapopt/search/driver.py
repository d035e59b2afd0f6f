"""Search: the fastest plan under a memory budget, with the baselines beside it.

``search_plan`` runs the registered strategies (``registry.STRATEGIES``, see
[Note: search strategies] in ``strategy.py``) in order:

1. the baselines (``baselines.py``);
2. the exact DP (per-unit reshard and checkpointing over contiguous
   groupings of the block chains, ``dp/``) on each shard-group size: FSDP
   over the world and, when the world spans nodes, HSDP with one node and
   whole nodes per shard group; plus the DP answer for each uniform choice;
3. uniform groupings, the smallest-memory plans (for the error message when
   nothing fits) and the baselines on the other shard groups;
4. with ``options.trials > 0``, an Optuna study over the general space
   (``study/``) seeded with all of the above.

It scores every plan they propose with the simulator and, among the plans whose
predicted peak fits the budget, hands back the simplest within the simulator's
measured error of the fastest (``choose.py``, [Note: plans within the error]):
one unit per block unless another cut beats it by more than that error. The simulator has the last word over the
DP's chain model (see [Note: chain model] in ``dp/chain.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError, PlanError
from wrapopt.fileio import fmt_bytes
from wrapopt.search.choose import ERROR_SOURCE, MEMORY_ERROR, choose
from wrapopt.search.dp.strategy import ExactDP
from wrapopt.search.registry import STRATEGIES
from wrapopt.search.torchtitan import TorchTitanLayouts
from wrapopt.search.strategy import (
    DEFAULT_TRIALS,
    History,
    Round,
    Scored,
    SearchOptions,
    Strategy,
    dp_shard_sizes,
    make_problem,
)
from wrapopt.search.study.strategy import OptunaStudy
from wrapopt.spec import MeshSpec, ModelGraph, PlanSpec
from wrapopt.units import validate_plan

__all__ = ["SearchResult", "SearchOptions", "Scored", "search_plan", "dp_shard_sizes", "DEFAULT_TRIALS",
           "ERROR_SOURCE"]  # ERROR_SOURCE: the report states it (report may read search.driver only)


@dataclass(frozen=True)
class SearchResult:
    best: Scored
    baselines: dict[str, Scored]
    candidates: tuple[Scored, ...] = field(repr=False)
    memory_budget: float
    notes: tuple[str, ...] = ()
    # Fitting plans not beaten in both time and memory by another, fastest first.
    pareto: tuple[Scored, ...] = field(default=(), repr=False)
    rounds: tuple[Round, ...] = field(default=(), repr=False)  # one per strategy, in the order run
    # 2-D search (search/tp.py): the tensor-parallel degree chosen, and the comparison rows
    # (best 1-D, best per degree, TorchTitan's default) as (label, scored).
    tp_chosen: int = 1
    tp_rows: tuple[tuple[str, Scored], ...] = field(default=(), repr=False)
    rows_head: str = ""  # what ``tp_rows`` compare, when not tensor-parallel degrees (cp, ep: search/axes.py)
    # The fastest fitting plan (``best`` is the simplest within the simulator's error of it:
    # See [Note: plans within the error] in choose.py), and one line saying why ``best`` won.
    fastest: Scored | None = field(default=None, repr=False)
    why: str = ""
    # Per tensor-parallel degree tried (``--tp auto``): (degree, what became of it), in order.
    tp_tried: tuple[tuple[int, str], ...] = field(default=(), repr=False)
    blocks: tuple[str, ...] = ()  # the searched model's blocks (``ModelGraph.blocks``), to describe units by kind
    # At a fixed global batch (search/batch.py): every micro-batch x accumulation split's ``BatchRow``.
    batch_rows: tuple[Any, ...] = field(default=(), repr=False)
    # 3-D search (search/pipeline.py): the best plan per pipeline degree (and TorchTitan's 405B layout)
    # as (label, scored), and per pipeline degree tried what became of it.
    pp_rows: tuple[tuple[str, Scored], ...] = field(default=(), repr=False)
    pp_tried: tuple[tuple[int, str], ...] = field(default=(), repr=False)
    pp_per_token: bool = False  # ``pp_rows`` compared per token (cp rows at a local batch: [Note: cp in a pipeline])
    # The throughput knobs of the answer's step: compile on or off and float8, each with why (one
    # line each: See [Note: knob defaults] in search/knobs.py); set by ``api.plan_model``.
    knobs: tuple[str, ...] = ()

    @property
    def best_baseline(self) -> Scored | None:
        fitting = [s for s in self.baselines.values() if s.fits]
        return min(fitting, key=lambda s: s.estimate.step_s) if fitting else None

    def round(self, strategy: str) -> Round | None:
        """The round of the strategy called ``strategy``; None when it did not run."""
        return next((r for r in self.rounds if r.strategy.name == strategy), None)

    def best_of(self, strategy: str) -> Scored | None:
        """The fastest fitting plan the strategy called ``strategy`` proposed (as the simulator scores it)."""
        r = self.round(strategy)
        return r.best if r is not None else None

    @property
    def dp_best(self) -> Scored | None:
        """The fastest fitting DP answer (as the simulator scores it)."""
        return self.best_of(ExactDP.name)

    @property
    def optuna_best(self) -> Scored | None:
        """The fastest fitting trial of the study."""
        return self.best_of(OptunaStudy.name)

    @property
    def study(self) -> object | None:
        """The study's ``StudyOutcome``; None without a study."""
        r = self.round(OptunaStudy.name)
        return r.detail if r is not None else None

    def lifted(self, lift: Callable[[PlanSpec], PlanSpec],
               keep: Callable[[PlanSpec], bool] | None = None) -> SearchResult:
        """This result with every plan put onto a larger mesh by ``lift`` (a view's plans onto the
        shape's mesh: tensor, context, expert parallelism), the plans ``keep`` rejects dropped (a
        shard group that cannot hold an axis's groups). When ``best`` is dropped, the fastest kept
        plan (fitting first) takes its place; ``InfeasibleError`` when none is kept."""
        ok = (lambda p: True) if keep is None else keep
        done: dict[int, Scored] = {}

        def one(s: Scored) -> Scored:
            hit = done.get(id(s))
            if hit is None:
                hit = done[id(s)] = replace(s, plan=lift(s.plan))
            return hit

        kept = [s for s in self.candidates if ok(s.plan)]
        best = self.best
        if not ok(best.plan):  # no-shard (shard group 1) and the like
            if not kept:
                raise InfeasibleError(f"no plan of {len(self.candidates)} scored can be lifted onto the mesh")
            best = min(kept, key=lambda s: (not s.fits, s.estimate.step_s))
        rounds = tuple(Round(r.strategy, tuple(lift(p) for p in r.proposed if ok(p)),
                             tuple(one(s) for s in r.scored if ok(s.plan)), r.detail) for r in self.rounds)
        fastest = self.fastest if self.fastest is None or not ok(self.fastest.plan) else one(self.fastest)
        return replace(self, best=one(best), baselines={k: one(s) for k, s in self.baselines.items() if ok(s.plan)},
                       candidates=tuple(map(one, kept)), pareto=tuple(one(s) for s in self.pareto if ok(s.plan)),
                       rounds=rounds, fastest=fastest,
                       tp_rows=tuple((label, one(s)) for label, s in self.tp_rows if ok(s.plan)))


def search_plan(
    graph: ModelGraph,
    sim: Simulator,
    mesh: MeshSpec,
    *,
    memory_budget: float | None = None,
    max_group: int | None = None,
    options: SearchOptions | None = None,
    strategies: Sequence[Strategy] | None = None,
) -> SearchResult:
    """Score the candidates and return the plan to use under ``memory_budget`` bytes: the
    simplest within the simulator's measured error of the fastest that fits (See [Note: plans
    within the error] in choose.py; ``SearchResult.fastest`` is the fastest, ``why`` says why).

    Without ``options`` (or with ``options.trials == 0``) no Optuna study runs:
    the answer is the best of the baselines, the DP answers and uniform
    groupings. ``strategies`` replaces the registered ones (a strategy's
    conformance test runs it alone). Raises ``InfeasibleError`` with the
    smallest predicted peak and what would make it fit when no plan fits.

    Example:
        >>> from wrapopt import zoo
        >>> from wrapopt.job import prepare
        >>> from wrapopt.spec import ParallelRequest
        >>> model, x = zoo.build("llama-tiny", "meta")
        >>> mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
        >>> job = prepare(ParallelRequest(mesh=mesh, memory_budget="none"), model, x)  # trace, profiles, simulator
        >>> res = search_plan(job.graph, job.sim, mesh, options=SearchOptions(trials=50, seed=0))
        >>> from wrapopt.search.choose import STEP_ERROR
        >>> res.best.estimate.step_s <= res.fastest.estimate.step_s * (1 + STEP_ERROR)
        True
    """
    problem = make_problem(graph, sim, mesh, memory_budget=memory_budget, max_group=max_group, options=options)
    budget = problem.memory_budget
    # The strategies aim at the budget less the memory model's error (the margin ``choose`` keeps);
    # a plan fits, and is shown as fitting, against the budget itself.
    problem = replace(problem, memory_budget=budget * (1 - MEMORY_ERROR))
    scored: list[Scored] = []
    by_key: dict[tuple, Scored] = {}
    rounds: list[Round] = []
    pruned: dict[str, int] = {}  # illegal proposals per strategy: skipped, counted, never fatal
    if strategies is None and problem.options.runtime == "torchtitan":  # See [Note: TorchTitan's plans]
        strategies = (TorchTitanLayouts(),)
    for strategy in STRATEGIES if strategies is None else strategies:
        proposal = strategy.propose(problem, History(tuple(rounds), tuple(scored)))
        mine = _score_proposal(graph, sim, strategy, proposal.plans, budget, scored, by_key, pruned)
        if proposal.num_illegal:  # ruled out by the strategy itself (the study's pruned trials)
            pruned[strategy.name] = pruned.get(strategy.name, 0) + proposal.num_illegal
        for s in proposal.evaluated:  # scored by the strategy itself: kept as they are
            s = replace(s, fits=s.estimate.peak_bytes <= budget, strategy=strategy.name)
            scored.append(s)
            mine.append(s)
        rounds.append(Round(strategy, tuple(proposal.plans), tuple(mine), proposal.detail))

    if not scored:
        names = ", ".join(r.strategy.name for r in rounds) or "none"
        raise InfeasibleError(f"no search strategy proposed a plan for {graph.model_class} on {mesh.world_size} ranks "
                              f"(strategies run: {names}); run the registered ones (strategies=None)")
    modes = problem.options.checkpoint_modes
    allowed = [s for s in scored if _checkpoints_in(s.plan, modes)]  # See [Note: the modes asked bind the answer]
    fitting = [s for s in allowed if s.fits]
    if not fitting:
        if allowed:
            raise InfeasibleError(_infeasible_message(sim, mesh, budget, allowed)
                                  + _modes_clause(modes, [s for s in scored if s.fits]))
        raise InfeasibleError(f"no plan proposed uses only the checkpointing {_mode_words(modes)} "
                              "(--checkpoint-modes); add full to --checkpoint-modes")
    choice = choose(graph, fitting, budget)
    notes = tuple(sorted({n for s in scored for n in s.estimate.notes}))
    notes += tuple(f"{n} illegal plan(s) proposed by {name} skipped (validate_plan refused them)"
                   for name, n in pruned.items())
    base = {s.plan.label: s for r in rounds if r.strategy.reference for s in r.scored}
    return SearchResult(best=choice.best, baselines=base, candidates=tuple(scored), memory_budget=budget, notes=notes,
                        pareto=_pareto(fitting), rounds=tuple(rounds), fastest=choice.fastest, why=choice.why,
                        blocks=tuple(graph.blocks))


# [Note: the modes asked bind the answer] ``--checkpoint-modes`` (``SearchOptions.checkpoint_modes``)
# says which activation checkpointing the job may use. The DP and the study choose only among them,
# but reference plans (``per-block,ckpt``, the smallest-memory plans) checkpoint whatever the modes
# say, so that the table shows them. They are scored and shown; the answer, the Pareto front and
# the out-of-memory message are drawn only from plans whose every unit uses a mode asked for. When
# none of those fits, the search says so, and names the checkpointed plans that would.
def _checkpoints_in(plan: PlanSpec, modes: Sequence[bool | str]) -> bool:
    """Whether every unit of ``plan`` checkpoints in one of ``modes``."""
    return all(u.checkpoint in modes for u in plan.units)


def _mode_words(modes: Sequence[bool | str]) -> str:
    return ",".join({False: "none", True: "full"}.get(m, str(m)) if isinstance(m, bool) else str(m) for m in modes)


def _modes_clause(modes: Sequence[bool | str], fitting_other: list[Scored]) -> str:
    """The clause after the out-of-memory message when plans outside ``modes`` fit."""
    if not fitting_other:
        return ""
    best = min(fitting_other, key=lambda s: s.estimate.step_s)
    return (f" Only --checkpoint-modes {_mode_words(modes)} was searched; with checkpointing, "
            f"{best.plan.label or 'a plan'} fits ({fmt_bytes(best.estimate.peak_bytes)}): add full to "
            "--checkpoint-modes.")


def _score_proposal(graph: ModelGraph, sim: Simulator, strategy: Strategy, plans: Sequence[PlanSpec], budget: float,
                    scored: list[Scored], by_key: dict[tuple, Scored], pruned: dict[str, int]) -> list[Scored]:
    """Score a strategy's plans (each plan once, unless the strategy is a reference), adding the new
    ones to ``scored`` and ``by_key`` and counting the illegal ones in ``pruned``."""
    mine: list[Scored] = []
    for plan in plans:
        s = None if strategy.reference else by_key.get(_key(plan))
        if s is None:
            try:
                # e.g. a block grouping that parts a module from the module reading its
                # parameters ([Note: parameter users] in units.py), or a split tied group
                validate_plan(graph, plan)
            except PlanError:
                pruned[strategy.name] = pruned.get(strategy.name, 0) + 1
                continue
            est = sim.simulate(plan)
            s = Scored(plan, est, est.peak_bytes <= budget, strategy=strategy.name)
            scored.append(s)
            by_key.setdefault(_key(plan), s)
        mine.append(s)
    return mine


def _key(plan: PlanSpec) -> tuple:
    return (plan.units, plan.mesh, plan.forward_prefetch)


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
           f"{fmt_bytes(smallest.estimate.peak_bytes)} ({plan.label or 'candidate'}, "
           f"shard group {plan.mesh.shard_size}: "
           f"sharded state {fmt_bytes(sharded)}, activations and working set {fmt_bytes(acts)}). To fit: ")
    advice = []
    if not all(u.full_checkpoint for u in plan.units if not u.is_root):
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
    # the other remedies are priced, not listed: See [Note: computed remedies] in search/remedies.py
    return msg + "; ".join(advice) + "."
