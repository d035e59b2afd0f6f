"""Which search runs for the options given: a fixed global batch (``search/batch.py``), the
tensor-parallel degrees (``search/tp.py``), the pipeline degrees (``search/pipeline.py``) or the
1-D search alone. ``api.plan_model`` calls ``run_search``; it packages the answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError, OptionError
from wrapopt.search.batch import global_batch_search
from wrapopt.search.driver import SearchOptions, SearchResult, search_plan
from wrapopt.search.pipeline import combine, resolve_pp, search_pipeline_degree, torchtitan_plan
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
    """The search the options ask for: See [Note: 2-D search], [Note: global batch search] and
    [Note: pipeline search]. Raises ``InfeasibleError`` when nothing fits."""
    degrees, spec, notes = resolve_tp(graph, mesh, tp, tp_plan)
    pp_degrees, layout, pp_notes = resolve_pp(graph, mesh, pp)
    notes = [*notes, *pp_notes]
    if global_batch is not None:
        if pp_degrees != (1,):
            raise OptionError("--global-batch with --pp is not supported yet: the pipeline's micro-batches are "
                              "searched at the traced batch per rank; drop --global-batch or pass --pp 1")
        found = global_batch_search(graph, sim, mesh, train=train, global_batch=global_batch, degrees=degrees,
                                    spec=spec, memory_budget=memory_budget, options=options)
        return SearchRun(found.result, found.train, found.sim, (*notes, *found.notes))

    def one_d() -> SearchResult:
        if degrees == (1,) and str(tp) != "auto":
            return search_plan(graph, sim, mesh, memory_budget=memory_budget, options=options)
        dropped = auto_degrees(graph, mesh, tp_plan)[2] if str(tp) == "auto" else ()  # say what became of each
        return search_tp(graph, sim, mesh, spec=spec, degrees=degrees, memory_budget=memory_budget,
                         options=options, dropped=dropped)

    if layout is None:  # no pipeline asked for, or --pp auto on a model that cannot be pipelined (a note says why)
        return SearchRun(one_d(), train, sim, tuple(notes))
    return SearchRun(_with_pipelines(graph, sim, mesh, layout, one_d, pp_degrees, degrees, spec, memory_budget),
                     train, sim, tuple(notes))


def _why_none(whys: dict[int, str], scored: list[Scored]) -> str:
    """Why a pipeline degree has no plan: the smallest peak over its tensor-parallel degrees, else each reason."""
    if scored:
        small = min(scored, key=lambda s: s.estimate.peak_bytes)
        return f"nothing fits: the smallest peak is {small.estimate.peak_bytes / 2**30:.2f} GiB ({small.plan.label})"
    return "; ".join(f"tp{t}: {w}" for t, w in whys.items()) or "no tensor-parallel degree divides the ranks left"


def _with_pipelines(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, layout: PipelineLayout,
                    one_d: Callable[[], SearchResult], pp_degrees: tuple[int, ...], tp_degrees: tuple[int, ...],
                    spec: TPSpec | None, memory_budget: float | None) -> SearchResult:
    """Degree 1 by today's search, every other pipeline degree at every tensor-parallel degree:
    See [Note: pipeline search]."""
    first: SearchResult | None = None
    tried: dict[int, str] = {}
    if 1 in pp_degrees:
        try:
            first = one_d()
        except InfeasibleError as e:
            tried[1] = "nothing fits: " + str(e).split(":")[0]
    best: dict[int, Scored] = {}
    scored: list[Scored] = []
    for pp in pp_degrees:
        if pp == 1:
            continue
        whys: dict[int, str] = {}
        for tp in tp_degrees:
            if mesh.world_size % (pp * tp):
                continue
            top, mine, why = search_pipeline_degree(graph, sim, mesh, layout, pp=pp, tp=tp, spec=spec,
                                                    memory_budget=memory_budget)
            scored += mine
            whys[tp] = why
            if top is not None and (pp not in best or top.estimate.step_s < best[pp].estimate.step_s):
                best[pp] = top
        if pp not in best:
            tried[pp] = _why_none(whys, [s for s in scored if s.plan.mesh.pp_size == pp])
    ref = torchtitan_plan(graph, sim, mesh, layout, spec, memory_budget) if spec is not None else None
    return combine(first, best, tried, scored, ref, memory_budget, tuple(graph.blocks))
