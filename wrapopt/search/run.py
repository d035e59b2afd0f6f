"""Which search runs for the options given: a fixed global batch (``search/batch.py``), the
tensor-parallel degrees (``search/tp.py``), the pipeline degrees (``search/pipeline.py``; at a
fixed global batch, ``search/pipeline_batch.py``) or the 1-D search alone. ``api.plan_model``
calls ``run_search``; it packages the answer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError, OptionError
from wrapopt.search.batch import BatchSearch, global_batch_search
from wrapopt.search.driver import SearchOptions, SearchResult, search_plan
from wrapopt.search.pipeline import combine, resolve_pp, search_pipeline_degree, torchtitan_plan
from wrapopt.search.pipeline_batch import PipelineBatch, pipeline_batch
from wrapopt.search.stages import PipelineLayout
from wrapopt.search.strategy import Scored
from wrapopt.search.tp import auto_degrees, resolve_tp, search_tp
from wrapopt.spec import MeshSpec, ModelGraph
from wrapopt.tp import TPSpec
from wrapopt.train import TrainConfig

__all__ = ["SearchRun", "run_search"]


@dataclass(frozen=True, slots=True)
class SearchRun:
    """What ``run_search`` found: the result, the training step and simulator of its answer, notes."""

    result: SearchResult
    train: TrainConfig
    sim: Simulator
    notes: tuple[str, ...] = ()


def run_search(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, *, train: TrainConfig, tp: Any,
               tp_plan: TPSpec | None, pp: Any, global_batch: int | None, memory_budget: float | None,
               options: SearchOptions) -> SearchRun:
    """The search the options ask for: See [Note: 2-D search], [Note: global batch search],
    [Note: pipeline search] and [Note: pipeline global batch]. Raises ``InfeasibleError`` when
    nothing fits, ``OptionError`` for a global batch no degree can run."""
    degrees, spec, notes = resolve_tp(graph, mesh, tp, tp_plan)
    pp_degrees, layout, pp_notes = resolve_pp(graph, mesh, pp)
    notes = [*notes, *pp_notes]

    def at_batch() -> BatchSearch:
        assert global_batch is not None
        return global_batch_search(graph, sim, mesh, train=train, global_batch=global_batch, degrees=degrees,
                                   spec=spec, memory_budget=memory_budget, options=options)

    def one_d() -> SearchResult:
        if degrees == (1,) and str(tp) != "auto":
            return search_plan(graph, sim, mesh, memory_budget=memory_budget, options=options)
        dropped = auto_degrees(graph, mesh, tp_plan)[2] if str(tp) == "auto" else ()  # say what became of each
        return search_tp(graph, sim, mesh, spec=spec, degrees=degrees, memory_budget=memory_budget,
                         options=options, dropped=dropped)

    if layout is None:  # no pipeline asked for, or --pp auto on a model that cannot be pipelined (a note says why)
        if global_batch is not None:
            found = at_batch()
            return SearchRun(found.result, found.train, found.sim, (*notes, *found.notes))
        return SearchRun(one_d(), train, sim, tuple(notes))
    if global_batch is None:
        return SearchRun(_with_pipelines(graph, sim, mesh, layout, one_d, pp_degrees, degrees, spec, memory_budget),
                         train, sim, tuple(notes))
    fixed = pipeline_batch(graph, sim, train, global_batch=global_batch, world_size=mesh.world_size,
                           memory_budget=memory_budget)
    first: list[BatchSearch] = []  # degree 1's search at the global batch, when it ran

    def one_d_at_batch() -> SearchResult:
        first.append(at_batch())
        return first[0].result

    result = _with_pipelines(graph, sim, mesh, layout, one_d_at_batch, pp_degrees, degrees, spec, memory_budget,
                             fixed=fixed)
    found_notes = first[0].notes if first else ()
    if result.best.plan.pipeline is None:
        return SearchRun(result, first[0].train, first[0].sim, (*notes, *found_notes))
    rows = tuple(replace(r, chosen=False) for r in result.batch_rows)  # degree 1's splits; the answer is below them
    return SearchRun(replace(result, batch_rows=rows), fixed.train_for(train, result.best.plan), fixed.sim,
                     (*notes, *found_notes))


def _why_none(whys: dict[int, str], scored: list[Scored]) -> str:
    """Why a pipeline degree has no plan: the smallest peak over its tensor-parallel degrees, else each reason."""
    if scored:
        small = min(scored, key=lambda s: s.estimate.peak_bytes)
        return f"nothing fits: the smallest peak is {small.estimate.peak_bytes / 2**30:.2f} GiB ({small.plan.label})"
    return "; ".join(f"tp{t}: {w}" for t, w in whys.items()) or "no tensor-parallel degree divides the ranks left"


def _with_pipelines(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, layout: PipelineLayout,
                    one_d: Callable[[], SearchResult], pp_degrees: tuple[int, ...], tp_degrees: tuple[int, ...],
                    spec: TPSpec | None, memory_budget: float | None, *,
                    fixed: PipelineBatch | None = None) -> SearchResult:
    """Degree 1 by today's search, every other pipeline degree at every tensor-parallel degree:
    See [Note: pipeline search]; ``fixed``: at a global batch, [Note: pipeline global batch]."""
    first: SearchResult | None = None
    tried: dict[int, str] = {}
    runs: list[tuple[int, int]] = []  # (pp, tp) that can run the global batch (all of them without one)
    one_units: list[int] = []  # without a split of the global batch at degree 1: what would work there
    one_runs = 1 in pp_degrees
    if one_runs:
        try:
            first = one_d()
        except InfeasibleError as e:
            tried[1] = "nothing fits: " + str(e).split(":")[0]
        except ValueError as e:  # at a global batch: no split at degree 1 (check_global_batch)
            if fixed is None:
                raise
            tried[1], one_runs = f"dropped: {e}", False
            one_units = [mesh.world_size // t * (fixed.micro_batch or 1) * (fixed.accumulation or 1)
                         for t in tp_degrees]
    psim = fixed.sim if fixed is not None else sim
    best: dict[int, Scored] = {}
    scored: list[Scored] = []
    pairs: list[tuple[int, int]] = []
    for pp in pp_degrees:
        if pp == 1:
            continue
        whys: dict[int, str] = {}
        for tp in tp_degrees:
            if mesh.world_size % (pp * tp):
                continue
            pairs.append((pp, tp))
            counts = None
            if fixed is not None:
                counts, why = fixed.counts(pp, tp)
                if not counts:
                    whys[tp] = why
                    continue
            runs.append((pp, tp))
            top, mine, why = search_pipeline_degree(graph, psim, mesh, layout, pp=pp, tp=tp, spec=spec,
                                                    memory_budget=memory_budget, counts=counts)
            scored += mine
            whys[tp] = why
            if top is not None and (pp not in best or top.estimate.step_s < best[pp].estimate.step_s):
                best[pp] = top
        if pp not in best:
            tried[pp] = _why_none(whys, [s for s in scored if s.plan.mesh.pp_size == pp])
    if fixed is not None and not runs and not one_runs:
        near = fixed.nearest(pairs, one_units)
        raise OptionError(f"--global-batch {fixed.global_batch}: no degree can run it ("
                          + "; ".join(f"pp{d}: {why}" for d, why in sorted(tried.items()))
                          + f"); global batches that work: {' and '.join(map(str, near)) or 'none'}")
    ref = (torchtitan_plan(graph, psim, mesh, layout, spec, memory_budget,
                           global_batch=fixed.global_batch if fixed is not None else None)
           if spec is not None else None)
    return combine(first, best, tried, scored, ref, memory_budget, tuple(graph.blocks))
