"""Expert-parallel degrees: which a request allows on a model, and the search of each beside FSDP alone.

[Note: expert parallel search] ``--ep N`` or ``--ep auto`` adds a degree loop to the flat shapes
(See [Note: shapes tried] in search/shapes.py): ``auto`` tries every degree above 1 that divides
the experts of every mixture of the model and the data-parallel x cp ranks it splits them over
(TorchTitan's rule); a degree given that the model cannot take is refused naming the module and
the degrees that would. Each degree is the 1-D search on its cost view (``Simulator.view``, See
[Note: expert parallel costs] in cost/ep.py), FSDP over every rank (``plan/ep.py`` applies
expert parallelism without HSDP), its plans lifted onto the mesh with ``ep_size``. The answer is
the smallest degree within the simulator's error of the fastest (FSDP alone is degree 1); the
report's rows list FSDP alone and each degree's best, a note what became of each degree tried.
"""

from __future__ import annotations

from dataclasses import replace

from wrapopt.cost.simulate import Simulator, ep_problem, expert_counts
from wrapopt.errors import InfeasibleError, PlanError
from wrapopt.search.choose import STEP_ERROR
from wrapopt.search.driver import SearchOptions, SearchResult, search_plan
from wrapopt.search.strategy import Scored, dp_shard_sizes
from wrapopt.spec import AUTO, MeshSpec, ModelGraph, ParallelRequest, Shape

__all__ = ["resolve_ep", "search_ep"]


def resolve_ep(graph: ModelGraph, request: ParallelRequest) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The expert-parallel degrees above 1 to try, and notes on the ones ``auto`` left out. A
    degree given that the model cannot take raises ``PlanError``. See [Note: expert parallel search]."""
    if request.ep == 1:
        return (), ()
    if request.global_batch is not None:  # search/batch.py splits the batch per tensor-parallel degree only
        if request.ep != AUTO:
            raise PlanError(f"--ep {request.ep} with --global-batch: expert parallelism is not searched at a fixed "
                            "global batch yet; drop --global-batch (and give --batch), or pass --ep 1")
        return (), ("--ep auto: not tried at a fixed global batch (not searched together yet)",)
    ranks = request.mesh.world_size  # the dp x cp ranks of a flat shape without tensor parallelism
    if request.ep != AUTO:
        problem = ep_problem(graph, request.ep)
        if problem:
            raise PlanError(problem)
        return (request.ep,), ()
    counts = expert_counts(graph)
    if not counts:
        return (), ("--ep auto: the model holds no stacked experts: expert parallelism not tried",)
    top = min(counts)
    degrees = tuple(d for d in range(2, top + 1) if all(n % d == 0 for n in counts) and ranks % d == 0)
    left = [d for d in range(2, top + 1) if all(n % d == 0 for n in counts) and ranks % d]
    notes = (f"--ep auto: ep {', '.join(map(str, left))} not tried: they do not divide the {ranks} ranks",) if left \
        else ()
    return degrees, notes


def _lift(s: Scored, ep: int) -> Scored:
    plan = replace(s.plan, mesh=replace(s.plan.mesh, ep_size=ep), label=f"{s.plan.label} + ep{ep}")
    return replace(s, plan=plan)


def _search_degree(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, ep: int, *, memory_budget: float | None,
                   max_group: int | None, options: SearchOptions | None) -> SearchResult:
    """The 1-D search on the ep view, its plans lifted onto the mesh with ``ep_size``."""
    # FSDP over every rank: plan/ep.py applies expert parallelism without HSDP
    sizes = tuple(s for s in ((options.shard_sizes if options else None) or dp_shard_sizes(mesh))
                  if s == mesh.world_size)
    if not sizes:
        raise InfeasibleError(f"ep {ep} is applied with FSDP over all {mesh.world_size} ranks, not under HSDP "
                              "(--shard-size)")
    opts = replace(options or SearchOptions(), shard_sizes=sizes)
    sub = sim.view(Shape(ep=ep))
    res = search_plan(graph, sub, mesh, memory_budget=memory_budget, max_group=max_group, options=opts)
    keep = [s for s in res.candidates if s.plan.mesh.shard_size % ep == 0]  # whole ep groups in a shard group
    if not keep:
        raise InfeasibleError(f"no plan of ep {ep} shards over whole groups of {ep} ranks")
    lifted = {id(s): _lift(s, ep) for s in keep}

    def one(s: Scored) -> Scored:
        return lifted.get(id(s)) or _lift(s, ep)

    best = res.best if res.best.plan.mesh.shard_size % ep == 0 else min(
        [s for s in keep if s.fits] or keep, key=lambda s: s.estimate.step_s)  # no-shard and the like: not ep
    return replace(res, best=one(best), candidates=tuple(lifted.values()),
                   baselines={k: one(s) for k, s in res.baselines.items() if s.plan.mesh.shard_size % ep == 0},
                   pareto=tuple(one(s) for s in res.pareto if s.plan.mesh.shard_size % ep == 0), rounds=())


def search_ep(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, *, degrees: tuple[int, ...],
              memory_budget: float | None, max_group: int | None = None,
              options: SearchOptions | None = None) -> SearchResult:
    """FSDP alone and each expert-parallel degree, searched and combined: See [Note: expert
    parallel search]."""
    results: dict[int, SearchResult] = {}
    failed: dict[int, str] = {}
    try:
        results[1] = search_plan(graph, sim, mesh, memory_budget=memory_budget, max_group=max_group, options=options)
    except InfeasibleError as e:
        failed[1] = str(e).split(";")[0]
    for d in degrees:
        try:
            results[d] = _search_degree(graph, sim, mesh, d, memory_budget=memory_budget, max_group=max_group,
                                        options=options)
        except InfeasibleError as e:
            failed[d] = str(e).split(";")[0]
    if not results:
        raise InfeasibleError(next(iter(failed.values())))
    fits = {d: r for d, r in results.items() if r.best.fits} or results
    top = min(r.best.estimate.step_s for r in fits.values())
    chosen = min(d for d, r in fits.items() if r.best.estimate.step_s <= top * (1 + STEP_ERROR))
    rows = tuple((("best FSDP alone (ep 1)" if d == 1 else f"best ep{d}"), r.best) for d, r in sorted(results.items()))
    ref = results[chosen].best.estimate.step_s
    tried = [f"ep {d}: " + ("chosen" if d == chosen else
                            f"{r.best.estimate.step_s / ref - 1:+.0%} step" + ("" if r.best.fits else ", does not fit"))
             for d, r in sorted(results.items())]
    tried += [f"ep {d}: nothing fits: {why}" for d, why in sorted(failed.items())]
    out = results[chosen]
    return replace(out, tp_rows=(*out.tp_rows, *rows), notes=(*out.notes, "expert parallel: " + "; ".join(tried)))
