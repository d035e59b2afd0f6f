"""The degree loop of an axis that splits the data-parallel ranks' work: context (cp) and expert
(ep) parallelism, searched one way.

[Note: the degree loop of an axis] Context and expert parallelism each add a degree loop over the
flat shapes (See [Note: shapes tried] in search/shapes.py); which degrees a request allows is the
axis's own question (``resolve_cp`` in search/cp.py, ``resolve_ep`` in search/ep.py). ``Axis``
holds what differs between the two:

- the cost view a degree's plans are searched on (``Simulator.for_cp`` / ``for_ep``), scoring plans
  on the mesh without the axis (FSDP over ``dp_shard x cp`` flattened; ep borrows its ranks from
  the data-parallel ones);
- the tensor-parallel degrees beside it: cp with ``--tp``'s, ep at tp 1 only (wrapopt has no cost
  view of experts under tensor parallelism; ``resolve_ep`` refuses ``--ep`` with ``--tp``);
- how degrees compare: cp per token (a degree's step runs ``1/cp`` of the tokens per GPU, since
  the local batch is per data-parallel rank, as TorchTitan's ``local_batch_size``: ``step x cp``,
  lower is faster), ep per step (the same tokens per GPU);
- the lift of a plan onto the mesh (``cp_size``, ``ep_size``).

``search_degrees`` runs each degree's flat search on its view. ``search_degrees_batch``, at a
fixed global batch, runs each degree's splits through the global-batch search (See [Note: global
batch search] in search/batch.py); every step there covers the same sequences, so degrees are
compared by the step itself. Plans are lifted before they are ranked (``SearchResult.lifted``,
those whose shard group cannot hold the axis's groups dropped). The answer is the smallest degree
within the simulator's error of the fastest among those that fit (all when none does). Degree 1
(no such parallelism) is tried under ``auto`` only: ``--cp 2`` and ``--ep 2`` are searched as
given, as ``--tp 2`` is. The report's rows list each degree's best; one note says what became of
each degree tried.

[Note: cp with ep] ``--cp`` with ``--ep`` (TorchTitan's sparse mesh: ep borrows its ranks from
``dp_shard x cp``) nests the loops: each cp degree's view is searched over the ep degrees, so a
plan is priced on the ep view of one cp rank's share (its experts' all-to-all carries that rank's
1/cp of the tokens), its shard groups holding whole cp and ep groups; cp degrees then compare per
token. Searched per local batch only (``ParallelRequest`` refuses both at a fixed global batch);
a pipeline shape takes both too (See [Note: ep in a pipeline] in search/shapes.py). Not applied by
wrapopt (``plan/ep.py`` refuses it naming the TorchTitan export, which writes both degrees).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError, OptionError
from wrapopt.search.batch import BatchSearch, batch_splits, nearest_batches, search_batch
from wrapopt.search.choose import STEP_ERROR
from wrapopt.search.cp import resolve_cp
from wrapopt.search.driver import SearchOptions, SearchResult
from wrapopt.search.ep import resolve_ep
from wrapopt.search.strategy import Scored, dp_shard_sizes, step_per_token
from wrapopt.spec import AUTO, ModelGraph, ParallelRequest, PlanSpec
from wrapopt.spec.cp import cp_ranks_per_node
from wrapopt.tp import TPSpec

__all__ = ["Axis", "CP", "EP", "AXES", "given_axes", "search_degrees", "search_degrees_batch"]


@dataclass(frozen=True, slots=True)
class Axis:
    """What differs between the axes that split the data-parallel ranks' work: See [Note: the
    degree loop of an axis]."""

    name: str  # "cp" or "ep": the flag ``--{name}``, the mesh field ``{name}_size``
    words: str  # "context parallel"
    per_token: bool  # degrees compared per token (a degree's step runs 1/degree of the tokens per GPU)
    with_tp: bool  # searched beside tensor-parallel degrees above 1

    def view(self, sim: Simulator, degree: int, *, tp: int, ranks_per_node: int) -> Simulator:
        """One rank's share of the axis at ``degree`` (beside tensor parallelism of ``tp``)."""
        if self.name == "cp":  # See [Note: context parallel costs] in cost/cp.py
            return sim.for_cp(degree, cp_ranks_per_node(degree, ranks_per_node, tp))[0]
        return sim.for_ep(degree)[0]  # See [Note: expert parallel costs] in cost/ep.py

    @staticmethod
    def shard_sizes(degree: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The shard groups of ``sizes`` a plan of ``degree`` may use: those that hold whole groups
        of the axis (FSDP over every data-parallel rank, or HSDP with the axis inside each shard group)."""
        return tuple(s for s in sizes if s % degree == 0)

    def lift(self, plan: PlanSpec, degree: int) -> PlanSpec:
        """A plan of the axis's view as the plan of the mesh with the axis at ``degree``."""
        mesh = plan.mesh.with_cp(degree) if self.name == "cp" else replace(plan.mesh, ep_size=degree)
        tag = f"{self.name}{degree}"
        return replace(plan, mesh=mesh, label=f"{plan.label} + {tag}" if plan.label else tag)

    def lift_result(self, res: SearchResult, degree: int) -> SearchResult:
        """Every plan of ``res`` whose shard group holds whole groups of ``degree``, lifted."""
        try:
            return res.lifted(functools.partial(self.lift, degree=degree),
                              lambda p: bool(self.shard_sizes(degree, (p.mesh.shard_size,))))
        except InfeasibleError:
            raise InfeasibleError(f"no plan shards over whole {self.name} groups of {degree}") from None

    def head(self, *, per_token: bool) -> str:
        """The report's line above the degrees' rows: what they compare."""
        how = "tokens/s per GPU compared" if self.per_token and per_token else "the same global batch; steps compared"
        return f"{self.words}ism ({how}; See [Note: the degree loop of an axis] in search/axes.py):"

    def row(self, degree: int, detail: str = "", *, per_token: bool = True) -> str:
        """The report's label of a degree's best plan (``best cp2 ...``, ``best without cp ...``);
        ``per_token``: say the share of the tokens a GPU runs (not at a fixed global batch)."""
        if degree == 1:
            return f"best without {self.name}" + (f" ({detail})" if detail else "")
        share = f"1/{degree} of the tokens per GPU" if self.per_token and per_token else ""
        said = ", ".join(w for w in (detail, share) if w)
        return f"best {self.name}{degree}" + (f" ({said})" if said else "")


CP = Axis("cp", "context parallel", per_token=True, with_tp=True)
EP = Axis("ep", "expert parallel", per_token=False, with_tp=False)
AXES = (CP, EP)


def given_axes(graph: ModelGraph, spec: PlanSpec, request: ParallelRequest) -> PlanSpec:
    """A given plan (``wrapopt estimate``) at the request's cp and ep degrees: as it is at 1 (a plan
    file keeps its own ``cp_size`` and ``ep_size``), else lifted onto the axis once the model takes
    the degree (``resolve_cp`` / ``resolve_ep``'s refusals) and the plan's shard group holds the
    axis's groups. ``auto`` is a search's: refused."""
    for axis, resolve in ((CP, resolve_cp), (EP, resolve_ep)):
        asked = getattr(request, axis.name)
        if asked == 1:
            continue
        flag = f"--{axis.name}"
        if asked == AUTO:
            raise OptionError(f"{flag} auto chooses a degree in `wrapopt search`; estimate scores one: give {flag} N")
        (d,), _notes = resolve(graph, request)
        have = getattr(spec.mesh, f"{axis.name}_size")
        if have not in (1, d):
            raise OptionError(f"{flag} {d}: the plan runs {axis.words}ism of degree {have}; drop {flag} or give "
                              "that degree")
        if have == 1 and not axis.shard_sizes(d, (spec.mesh.shard_size,)):
            raise OptionError(f"{flag} {d}: the plan's shard group of {spec.mesh.shard_size} ranks cannot hold "
                              f"{axis.name} groups of {d} (it must be a multiple of {d}); give another degree or a "
                              "plan whose shard group can")
        spec = spec if have == d else axis.lift(spec, d)
    return spec


def _choose(axis: Axis, bests: dict[int, Scored], cost: Callable[[int], float], unit: str,
            tail: Callable[[int], str] | None = None) -> tuple[int, list[str]]:
    """The smallest degree whose ``cost`` is within the simulator's error of the lowest among the
    degrees whose best fits (among all when none does), and what became of each degree, in words."""
    fits = [c for c, s in bests.items() if s.fits] or list(bests)
    top = min(cost(c) for c in fits)
    chosen = min(c for c in fits if cost(c) <= top * (1 + STEP_ERROR))
    said = [f"{axis.name} {c}: " + ("chosen" if c == chosen else f"{cost(c) / cost(chosen):.2f}x {unit}"
                                   + ("" if s.fits else ", does not fit")) + (tail(c) if tail else "")
            for c, s in sorted(bests.items())]
    return chosen, said


def _tried(axis: Axis, request: ParallelRequest, degrees: tuple[int, ...]) -> tuple[int, ...]:
    return ((1,) if getattr(request, axis.name) == AUTO else ()) + tuple(degrees)


def search_degrees(graph: ModelGraph, sim: Simulator, request: ParallelRequest, axis: Axis, *,
                   degrees: tuple[int, ...], flat: Callable[[Simulator, SearchOptions, bool], SearchResult],
                   options: SearchOptions, where: str = "") -> SearchResult:
    """Each degree of ``axis`` (1 too under ``auto``) searched by ``flat(view, options, with_tp)``
    (the flat search on that degree's view, its shard groups limited as the axis says; ``with_tp``:
    beside the request's tensor-parallel degrees) and combined: See [Note: the degree loop of an
    axis]. ``where``: what the note's degrees are under, said after its head ("at the chosen cp degree")."""
    mesh = request.mesh
    tp = request.tp if isinstance(request.tp, int) else 1
    results: dict[int, SearchResult] = {}
    failed: dict[int, str] = {}
    for d in _tried(axis, request, degrees):
        try:
            if d == 1:
                results[1] = flat(sim, options, True)
                continue
            sizes = axis.shard_sizes(d, tuple(options.shard_sizes or dp_shard_sizes(mesh)))
            if not sizes:
                raise InfeasibleError(f"no shard group holds whole {axis.name} groups of {d}")
            view = axis.view(sim, d, tp=tp, ranks_per_node=mesh.ranks_per_node)
            results[d] = axis.lift_result(flat(view, replace(options, shard_sizes=sizes), axis.with_tp), d)
        except InfeasibleError as e:
            failed[d] = str(e).split(";")[0]
    if not results:
        raise InfeasibleError(next(iter(failed.values())))

    chosen, said = _choose(axis, {d: r.best for d, r in results.items()}, lambda d: step_per_token(results[d].best),
                           "the time per token" if axis.per_token else "the step")
    rows = tuple((axis.row(d), r.best) for d, r in sorted(results.items()))
    said += [f"{axis.name} {d}: nothing fits: {why}" for d, why in sorted(failed.items())]
    out = results[chosen]
    head = (f"{axis.words} (tokens/s per GPU compared)" if axis.per_token else axis.words) + (f" {where}" if where
                                                                                               else "")
    return replace(out, tp_rows=(*out.tp_rows, *(rows if len(results) > 1 else ())),
                   rows_head=axis.head(per_token=True) if len(results) > 1 else out.rows_head,
                   notes=(*out.notes, f"{head}: " + "; ".join(said)))


def search_degrees_batch(graph: ModelGraph, sim: Simulator, request: ParallelRequest, axis: Axis, *,
                         degrees: tuple[int, ...], tp_degrees: tuple[int, ...], spec: TPSpec | None,
                         memory_budget: float | None, options: SearchOptions) -> BatchSearch:
    """Each degree of ``axis`` (1 too under ``auto``) at the request's fixed global batch, over the
    tensor-parallel ``tp_degrees`` (tp 1 alone where the axis is not searched beside tp), and the
    fastest step that fits: See [Note: the degree loop of an axis] and, for cp's splits, [Note:
    context parallel at a global batch] in search/cp.py. Raises ValueError when no degree has a
    split of the batch, InfeasibleError when none fits."""
    mesh, batch = request.mesh, request.batch
    assert batch is not None, "search_degrees_batch needs a request with a global batch"
    found: dict[int, BatchSearch] = {}
    failed: dict[int, str] = {}
    units: set[int] = set()
    for d in _tried(axis, request, degrees):
        tps = tp_degrees if d == 1 or axis.with_tp else (1,)
        split_by = d if axis.per_token else 1  # cp's ranks split each sequence; ep's read their own
        ranks = {t: mesh.world_size // (t * split_by) for t in tps if mesh.world_size % (t * split_by) == 0}
        units |= {r * (batch.micro_batch or 1) * (batch.accumulation or 1) for r in ranks.values()}
        splits = batch_splits(batch, ranks, **{axis.name: d})
        if not splits:
            failed[d] = (f"global batch {batch.sequences} has no split over its "
                         f"{' or '.join(map(str, sorted(set(ranks.values()))))} ranks that read different sequences")
            continue
        try:
            found[d] = search_batch(graph, sim, mesh, train=request.train, splits=splits, spec=spec,
                                    memory_budget=memory_budget, options=options,
                                    axis=None if d == 1 else (axis, d))
        except InfeasibleError as e:
            failed[d] = "nothing fits: " + str(e).split(";")[0]
    if not found:
        if all(why.startswith("global batch") for why in failed.values()):
            near = nearest_batches(batch.sequences, sorted(units))
            raise ValueError(f"global batch {batch.sequences} has no split at any {axis.name} degree tried ("
                             + "; ".join(f"{axis.name} {d}: {why}" for d, why in sorted(failed.items()))
                             + f"); the nearest that work are {' and '.join(map(str, near)) or 'none'}")
        first = next(why for why in failed.values() if not why.startswith("global batch"))
        raise InfeasibleError(f"{first.removeprefix('nothing fits: ')} (at every {axis.name} degree tried: "
                              f"{', '.join(map(str, sorted(failed)))})")
    chosen, said = _choose(axis, {d: r.result.best for d, r in found.items()},
                           lambda d: found[d].result.best.estimate.step_s, "the step",
                           tail=lambda d: f" ({found[d].split.describe()})")
    said += [f"{axis.name} {d}: {why}" for d, why in sorted(failed.items())]
    rows = tuple((axis.row(d, r.split.describe(), per_token=False), r.result.best) for d, r in sorted(found.items()))
    out = found[chosen]
    result = replace(out.result, tp_rows=(*out.result.tp_rows, *(rows if len(found) > 1 else ())),
                     rows_head=axis.head(per_token=False) if len(found) > 1 else out.result.rows_head,
                     notes=(*out.result.notes, f"{axis.words} at the global batch of {batch.sequences} "
                            "sequences (steps compared): " + "; ".join(said)))
    return replace(out, result=result)
