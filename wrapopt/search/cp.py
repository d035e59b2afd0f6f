"""Context-parallel degrees: which a request allows on a model, and the search of each, jointly with
the tensor-parallel degree and the FSDP plan.

[Note: context parallel search] ``--cp N`` or ``--cp auto`` adds a degree loop to the flat shapes
(See [Note: shapes tried] in search/shapes.py). ``auto`` tries 1 and every power of two that splits
the sequence into ``2 x cp`` chunks (the head-tail load balancer's) and divides the data-parallel
ranks; a degree given that the sequence or the model cannot take is refused, naming the degrees
that would or the module whose attention is not SDPA (``cost/cp.py``'s ``cp_refusal``). Each degree
is the flat search (FSDP alone, or ``--tp``'s degrees: See [Note: 2-D search]) on its cost view
(``Simulator.for_cp``, See [Note: context parallel costs] in cost/cp.py), its shard groups the
multiples of the degree (FSDP shards over ``dp_shard x cp``), its plans lifted onto the mesh with
``cp_size``. A degree's step runs ``1/cp`` of the tokens per GPU (the local batch is per
data-parallel rank, as TorchTitan's ``local_batch_size``: the cp ranks split its sequences), so the
degrees are compared by tokens per second per GPU, ``step x cp`` lower is faster; the answer is the
smallest degree within the simulator's error of the fastest that fits. The report's rows list
each degree's best, a note what became of each degree tried.

[Note: context parallel at a global batch] With ``--global-batch N`` the sequences per step are
fixed, and a cp degree c leaves ``world / (t x c)`` ranks that read different sequences, so each
degree has its own splits ``N = micro_batch x accumulation x world / (t x c)`` (``batch_splits``
with ``cp``). Each degree's splits are the global-batch search (See [Note: global batch search] in
search/batch.py), each split priced on the cp view of its own simulator and searched with shard
groups that hold whole cp groups; the answer is lifted onto the cp mesh. Every degree's step then
covers the same N sequences, so the degrees are compared by the step itself (not per token, as
above), and the smallest within the simulator's error of the fastest that fits wins; a degree
with no split of N (the ranks left do not divide it) is named in the notes.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable

from wrapopt.spec.cp import cp_degrees, cp_ranks_per_node, cp_refusal
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError, OptionError, PlanError
from wrapopt.search.batch import BatchSearch, batch_splits, nearest_batches, search_batch
from wrapopt.search.choose import STEP_ERROR
from wrapopt.search.driver import SearchOptions, SearchResult
from wrapopt.search.strategy import Round, Scored, dp_shard_sizes
from wrapopt.spec import AUTO, ModelGraph, ParallelRequest, PlanSpec
from wrapopt.tp import TPSpec

__all__ = ["resolve_cp", "search_cp", "search_cp_batch", "lift_cp", "given_cp"]


def resolve_cp(graph: ModelGraph, request: ParallelRequest) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The context-parallel degrees above 1 to try, and notes on what ``auto`` left out. A degree
    given that the model or the sequence cannot take raises ``PlanError`` / ``OptionError``. See
    [Note: context parallel search]."""
    if request.cp == 1:
        return (), ()
    if request.asks_pp:
        raise OptionError(f"--cp {request.cp} with --pp {request.pp}: context parallelism under a pipeline is not "
                          "searched yet; pass --pp 1")
    why = cp_refusal(graph)
    fixed_tp = request.tp if isinstance(request.tp, int) else 1
    ranks = request.mesh.world_size // fixed_tp  # the data-parallel ranks cp splits (under tp auto: each degree's)
    seq = graph.seq_len
    if request.cp != AUTO:
        if why:
            raise PlanError(f"--cp {request.cp}: {why}")
        cp = int(request.cp)
        if seq % (2 * cp):
            works = [c for c in range(2, seq + 1) if seq % (2 * c) == 0 and ranks % c == 0][:8]
            raise OptionError(f"--cp {cp} does not split the sequence of {seq} tokens into 2 x {cp} chunks (the "
                              f"causal load balancer's); degrees that do: {', '.join(map(str, works)) or 'none'}")
        return (cp,), ()
    if why:
        return (), (f"--cp auto: context parallelism not tried: {why}",)
    degrees = cp_degrees(seq, ranks)
    return degrees, () if degrees else (
        f"--cp auto: no degree splits the sequence of {seq} tokens into 2 x cp chunks and divides the {ranks} "
        "data-parallel ranks",)


def lift_cp(plan: PlanSpec, cp: int) -> PlanSpec:
    """A plan of the flattened ``dp_shard x cp`` mesh with its cp axis (its shard group a multiple of ``cp``)."""
    return replace(plan, mesh=plan.mesh.with_cp(cp), label=f"{plan.label} + cp{cp}" if plan.label else f"cp{cp}")


def given_cp(graph: ModelGraph, spec: PlanSpec, request: ParallelRequest) -> PlanSpec:
    """A given plan (``wrapopt estimate``) at the request's cp degree: the plan as it is at 1 (a plan
    file keeps its own ``cp_size``), else lifted onto the cp mesh once the model and the sequence
    take the degree (``resolve_cp``'s refusals). ``auto`` is a search's: refused. An expert-parallel
    degree is not lifted here: a plan file keeps its own ``ep_size``; ``--ep`` is refused."""
    if request.ep != 1:
        raise OptionError(f"--ep {request.ep}: estimate does not put a plan on expert-parallel ranks; search with "
                          f"--ep {request.ep} (wrapopt search --out plan.json) and estimate that plan file")
    if request.cp == 1:
        return spec
    if request.cp == AUTO:
        raise OptionError("--cp auto chooses a degree in `wrapopt search`; estimate scores one: give --cp N")
    (cp,), _notes = resolve_cp(graph, request)
    if spec.mesh.cp_size not in (1, cp):
        raise OptionError(f"--cp {cp}: the plan runs context parallelism of degree {spec.mesh.cp_size}; drop --cp "
                          "or give that degree")
    if spec.mesh.shard_size % cp:
        raise OptionError(f"--cp {cp}: the plan's shard group of {spec.mesh.shard_size} ranks does not hold whole cp "
                          f"groups (FSDP shards over dp_shard x cp); give a cp dividing {spec.mesh.shard_size}")
    return spec if spec.mesh.cp_size == cp else lift_cp(spec, cp)


def _lift_result(res: SearchResult, cp: int) -> SearchResult:
    """Every plan of ``res`` that shards over whole cp groups, lifted onto the cp mesh."""
    ok = [s for s in res.candidates if s.plan.mesh.shard_size % cp == 0]
    lifted = {id(s): replace(s, plan=lift_cp(s.plan, cp)) for s in ok}

    def one(s: Scored) -> Scored:
        return lifted.get(id(s)) or replace(s, plan=lift_cp(s.plan, cp))

    def fine(s: Scored) -> bool:
        return s.plan.mesh.shard_size % cp == 0

    best = res.best
    if not fine(best):  # no-shard (shard group 1) cannot hold a cp group: the best of those that can
        if not ok:
            raise InfeasibleError(f"no plan shards over whole cp groups of {cp}")
        best = min(ok, key=lambda s: (not s.fits, s.estimate.step_s))
    rounds = tuple(Round(r.strategy, tuple(lift_cp(p, cp) for p in r.proposed if p.mesh.shard_size % cp == 0),
                         tuple(one(s) for s in r.scored if fine(s)), r.detail) for r in res.rounds)
    return replace(res, best=one(best), baselines={k: one(s) for k, s in res.baselines.items() if fine(s)},
                   candidates=tuple(lifted.values()), pareto=tuple(one(s) for s in res.pareto if fine(s)),
                   rounds=rounds, tp_rows=tuple((label, one(s)) for label, s in res.tp_rows if fine(s)))


def _choose(bests: dict[int, Scored], cost: Callable[[int], float], unit: str,
            tail: Callable[[int], str] | None = None) -> tuple[int, list[str]]:
    """The smallest degree whose ``cost`` is within the simulator's error of the lowest among the
    degrees whose best fits (among all when none does), and what became of each degree, in words."""
    fits = [c for c, s in bests.items() if s.fits] or list(bests)
    top = min(cost(c) for c in fits)
    chosen = min(c for c in fits if cost(c) <= top * (1 + STEP_ERROR))
    said = [f"cp {c}: " + ("chosen" if c == chosen else f"{cost(c) / cost(chosen):.2f}x {unit}"
                           + ("" if s.fits else ", does not fit")) + (tail(c) if tail else "")
            for c, s in sorted(bests.items())]
    return chosen, said


def search_cp(graph: ModelGraph, sim: Simulator, request: ParallelRequest, *, degrees: tuple[int, ...],
              flat: Callable[[Simulator, SearchOptions], SearchResult], options: SearchOptions) -> SearchResult:
    """Each context-parallel degree (1 too under ``auto``) searched by ``flat(view, options)``
    (the flat search on that degree's view, its shard groups limited to multiples of the degree)
    and combined: See [Note: context parallel search]."""
    mesh = request.mesh
    tried = ((1,) if request.cp == AUTO else ()) + tuple(degrees)
    results: dict[int, SearchResult] = {}
    failed: dict[int, str] = {}
    for cp in tried:
        try:
            if cp == 1:
                results[1] = flat(sim, options)
                continue
            sizes = tuple(s for s in (options.shard_sizes or dp_shard_sizes(mesh)) if s % cp == 0)
            if not sizes:
                raise InfeasibleError(f"no shard group holds whole cp groups of {cp}")
            per_node = cp_ranks_per_node(cp, mesh.ranks_per_node, request.tp if isinstance(request.tp, int) else 1)
            view = sim.for_cp(cp, per_node)[0]
            results[cp] = _lift_result(flat(view, replace(options, shard_sizes=sizes)), cp)
        except InfeasibleError as e:
            failed[cp] = str(e).split(";")[0]
    if not results:
        raise InfeasibleError(next(iter(failed.values())))

    def per_token(c: int) -> float:  # seconds per GPU per token, up to a constant: See the note
        return results[c].best.estimate.step_s * c

    chosen, said = _choose({c: r.best for c, r in results.items()}, per_token, "the time per token")
    rows = tuple(((f"best cp{c} (1/{c} of the tokens per GPU)" if c > 1 else "best without cp"), r.best)
                 for c, r in sorted(results.items()))
    said += [f"cp {c}: nothing fits: {why}" for c, why in sorted(failed.items())]
    out = results[chosen]
    return replace(out, tp_rows=(*out.tp_rows, *(rows if len(results) > 1 else ())),
                   notes=(*out.notes, "context parallel (tokens/s per GPU compared): " + "; ".join(said)))


def search_cp_batch(graph: ModelGraph, sim: Simulator, request: ParallelRequest, *, degrees: tuple[int, ...],
                    tp_degrees: tuple[int, ...], spec: TPSpec | None, memory_budget: float | None,
                    options: SearchOptions) -> BatchSearch:
    """Each context-parallel degree (1 too under ``auto``) at the request's fixed global batch, over
    the tensor-parallel ``tp_degrees``, and the fastest step that fits: See [Note: context parallel
    at a global batch]. Raises ValueError when no degree has a split of the batch, InfeasibleError
    when none fits."""
    mesh, batch = request.mesh, request.batch
    assert batch is not None, "search_cp_batch needs a request with a global batch"
    tried = ((1,) if request.cp == AUTO else ()) + tuple(degrees)
    found: dict[int, BatchSearch] = {}
    failed: dict[int, str] = {}
    units: set[int] = set()
    for cp in tried:
        ranks = {t: mesh.world_size // (t * cp) for t in tp_degrees if mesh.world_size % (t * cp) == 0}
        units |= {r * (batch.micro_batch or 1) * (batch.accumulation or 1) for r in ranks.values()}
        splits = batch_splits(batch, ranks, cp)
        if not splits:
            failed[cp] = (f"global batch {batch.sequences} has no split over its "
                          f"{' or '.join(map(str, sorted(set(ranks.values()))))} ranks that read different sequences")
            continue
        try:
            found[cp] = search_batch(graph, sim, mesh, train=request.train, splits=splits, spec=spec,
                                     memory_budget=memory_budget, options=options,
                                     lift=None if cp == 1 else functools.partial(_lift_result, cp=cp))
        except InfeasibleError as e:
            failed[cp] = "nothing fits: " + str(e).split(";")[0]
    if not found:
        if all(why.startswith("global batch") for why in failed.values()):
            near = nearest_batches(batch.sequences, sorted(units))
            raise ValueError(f"global batch {batch.sequences} has no split at any cp degree tried ("
                             + "; ".join(f"cp {c}: {why}" for c, why in sorted(failed.items()))
                             + f"); the nearest that work are {' and '.join(map(str, near)) or 'none'}")
        first = next(why for why in failed.values() if not why.startswith("global batch"))
        raise InfeasibleError(f"{first.removeprefix('nothing fits: ')} (at every cp degree tried: "
                              f"{', '.join(map(str, sorted(failed)))})")
    chosen, said = _choose({c: r.result.best for c, r in found.items()},
                           lambda c: found[c].result.best.estimate.step_s, "the step",
                           tail=lambda c: f" ({found[c].split.describe()})")
    said += [f"cp {c}: {why}" for c, why in sorted(failed.items())]
    rows = tuple(((f"best cp{c} ({r.split.describe()})" if c > 1 else f"best without cp ({r.split.describe()})"),
                  r.result.best) for c, r in sorted(found.items()))
    out = found[chosen]
    result = replace(out.result, tp_rows=(*out.result.tp_rows, *(rows if len(found) > 1 else ())),
                     notes=(*out.result.notes, f"context parallel at the global batch of {batch.sequences} "
                            "sequences (steps compared): " + "; ".join(said)))
    return replace(out, result=result)
