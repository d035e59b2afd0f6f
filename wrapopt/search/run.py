"""``run_search``: one search over the shapes a request allows, and one combine step.

``search/shapes.py`` generates the shapes (See [Note: shapes tried]); each group is searched
the way its shape needs (no pipeline: the 1-D search on each tensor-parallel view, at every split
of a fixed global batch; a pipeline: the pipeline search per degree); ``combine`` in
search/pipeline.py picks the answer over the pipeline degrees and keeps every shape's row.
``api.plan_model`` calls ``run_search`` with the job's request; it packages the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError, OptionError
from wrapopt.fileio import fmt_bytes
from wrapopt.search.batch import global_batch_search
from wrapopt.search.axes import CP, EP, search_degrees, search_degrees_batch
from wrapopt.search.driver import SearchOptions, SearchResult
from wrapopt.search.pipeline import combine, search_pipeline_degree, torchtitan_plan
from wrapopt.search.pipeline_batch import PipelineBatch, pipeline_batch
from wrapopt.search.shapes import ShapeSpace, shape_space
from wrapopt.search.strategy import Scored, compared_step
from wrapopt.search.tp import search_shape, search_tp
from wrapopt.spec import AUTO, ModelGraph, ParallelRequest, Shape
from wrapopt.train import TrainConfig

__all__ = ["SearchRun", "run_search"]


@dataclass(frozen=True, slots=True)
class SearchRun:
    """What ``run_search`` found: the result, the training step and simulator of its answer, notes."""

    result: SearchResult
    train: TrainConfig
    sim: Simulator
    notes: tuple[str, ...] = ()


def run_search(graph: ModelGraph, sim: Simulator, request: ParallelRequest, *, memory_budget: float | None,
               options: SearchOptions) -> SearchRun:
    """The search the request asks for: See [Note: shapes tried], [Note: 2-D search], [Note: global
    batch search], [Note: pipeline search] and [Note: pipeline global batch]. Raises
    ``InfeasibleError`` when nothing fits, ``OptionError`` for a global batch no shape can run."""
    space = shape_space(graph, request)
    # See [Note: async tensor parallel] in cost/tp.py
    asked = request.async_tp
    if options.runtime == "torchtitan" and asked == AUTO and space.tp_spec is not None and not request.train.compile:
        asked = False  # TorchTitan runs async TP only under torch.compile: See [Note: knob defaults]
    spec, why = sim.with_async(space.tp_spec, asked)
    if asked is not request.async_tp:
        why = ("--async-tp auto: off under --runtime torchtitan without compile (--no-compile): TorchTitan runs "
               "async TP only under torch.compile")
    space = replace(space, tp_spec=spec, notes=(*space.notes, *([why] if why and request.asks_tp else [])))
    if not space.piped:  # no pipeline asked for, or --pp auto on a model that cannot be pipelined (a note says why)
        flat = search_flat(graph, sim, request, space, memory_budget=memory_budget, options=options)
        # the report's notes say why --pp auto searched no pipeline, as the --tp auto line says for tp
        said = tuple(n for n in space.notes if n.startswith("--pp"))
        result = replace(flat.result, notes=(*said, *flat.result.notes)) if said else flat.result
        return replace(flat, result=result, notes=(*space.notes, *flat.notes))
    fixed = pipeline_batch(graph, sim, request, memory_budget=memory_budget) if request.global_batch else None
    flat, tried, one_units = None, {}, []
    flat_runs = bool(space.flat)  # a flat shape can run the request (a global batch: has a split)
    if space.flat:
        try:
            flat = search_flat(graph, sim, request, space, memory_budget=memory_budget, options=options)
        except InfeasibleError as e:
            tried[1] = "nothing fits: " + str(e).split(":")[0]
        except ValueError as e:  # at a global batch: no split without a pipeline (check_global_batch)
            if fixed is None:
                raise
            tried[1], flat_runs = f"dropped: {e}", False
            one_units = [request.mesh.world_size // t * (fixed.micro_batch or 1) * (fixed.accumulation or 1)
                         for t in space.tp_degrees]
    result = _with_pipelines(graph, sim if fixed is None else fixed.sim, request, space, flat, tried,
                             one_units if not flat_runs else None, memory_budget=memory_budget, fixed=fixed,
                             refine=options.runtime != "torchtitan")  # See [Note: TorchTitan's plans]
    notes = (*space.notes, *(flat.notes if flat is not None else ()))
    if result.best.plan.pipeline is None:
        assert flat is not None
        return SearchRun(result, flat.train, flat.sim, notes)
    if fixed is None:
        return SearchRun(result, request.train, sim, notes)
    rows = tuple(replace(r, chosen=False) for r in result.batch_rows)  # the flat splits; the answer is below them
    return SearchRun(replace(result, batch_rows=rows), fixed.train_for(request.train, result.best.plan),
                     fixed.sim_for(result.best.plan.mesh.cp_size),
                     notes)


def search_flat(graph: ModelGraph, sim: Simulator, request: ParallelRequest, space: ShapeSpace, *,
                memory_budget: float | None, options: SearchOptions) -> SearchRun:
    """The shapes without a pipeline: at a fixed global batch every split of each (See [Note:
    global batch search]), else the 1-D search on each tensor-parallel degree (See [Note: 2-D
    search]; FSDP alone when that is all the request asks); with context or expert parallelism,
    each of its degrees so (See [Note: the degree loop of an axis] in search/axes.py)."""
    degrees = tuple(s.tp for s in space.flat)
    axis, axis_degrees = (CP, space.cp) if space.cp else (EP, space.ep) if space.ep else (None, ())
    if request.global_batch is not None:
        if axis is not None:
            found = search_degrees_batch(graph, sim, request, axis, degrees=axis_degrees, tp_degrees=degrees,
                                         spec=space.tp_spec, memory_budget=memory_budget, options=options)
        else:
            found = global_batch_search(graph, sim, request, degrees=degrees, spec=space.tp_spec,
                                        memory_budget=memory_budget, options=options)
        return SearchRun(found.result, found.train, found.sim, found.notes)

    def flat(s: Simulator, opts: SearchOptions, with_tp: bool = True) -> SearchResult:
        if not with_tp or (degrees == (1,) and request.tp != AUTO):  # FSDP alone: no degree to compare
            return search_shape(graph, s, request.mesh, Shape(), spec=None, memory_budget=memory_budget,
                                options=opts)
        return search_tp(graph, s, request.mesh, spec=space.tp_spec, degrees=degrees, memory_budget=memory_budget,
                         options=opts, dropped=space.tp_dropped)

    if axis is None:
        return SearchRun(flat(sim, options), request.train, sim)
    if space.cp and space.ep:  # each cp degree's view searched over the ep degrees: See [Note: cp with ep]
        inner = flat

        def flat(s: Simulator, opts: SearchOptions, with_tp: bool = True) -> SearchResult:
            # only the chosen cp degree's result is kept: its ep note says which cp degree it is for
            return search_degrees(graph, s, request, EP, degrees=space.ep, options=opts,
                                  flat=lambda v, o, w: inner(v, o, w and with_tp), where="at the chosen cp degree")
    return SearchRun(search_degrees(graph, sim, request, axis, degrees=axis_degrees, flat=flat, options=options),
                     request.train, sim)


def _why_none(whys: dict[int | str, str], scored: list[Scored]) -> str:
    """Why a pipeline degree has no plan: the smallest peak over its tensor-parallel degrees, else each reason."""
    if scored:
        small = min(scored, key=lambda s: s.estimate.peak_bytes)
        return f"nothing fits: the smallest peak is {fmt_bytes(small.estimate.peak_bytes)} ({small.plan.label})"
    return "; ".join(f"tp{t}: {w}" for t, w in whys.items()) or "no tensor-parallel degree divides the ranks left"


def _with_pipelines(graph: ModelGraph, psim: Simulator, request: ParallelRequest, space: ShapeSpace,
                    flat: SearchRun | None, tried: dict[int, str], one_units: list[int] | None, *,
                    memory_budget: float | None, fixed: PipelineBatch | None, refine: bool = True) -> SearchResult:
    """Every pipeline shape of ``space`` beside the flat answer (``flat``; ``tried`` says why there
    is none), combined: See [Note: pipeline search]; ``fixed``: at a global batch, [Note: pipeline
    global batch]. ``one_units``: when no flat shape can run the global batch, the global batches
    they would run (multiples of these), for the error that no shape can."""
    mesh, layout = request.mesh, space.layout
    assert layout is not None
    best: dict[int, Scored] = {}
    scored: list[Scored] = []
    whys: dict[int, dict[int | str, str]] = {}
    runs: list[Shape] = []  # the pipeline shapes that can run the global batch (all of them without one)
    axes = tuple(n for n, ds in (("cp", space.cp), ("ep", space.ep)) if ds)  # the pipelines' cp and ep degrees:
    by_axis: dict[tuple[int, int, int], Scored] = {}  # the fastest per (pp, cp, ep): See [Note: cp in a pipeline]
    none_axis: dict[tuple[int, int, int], str] = {}  # (pp, cp, ep) with no plan that fits, and why

    def named(c: int, e: int) -> str:  # "cp2", "cp1 ep2": the degrees of the axes searched
        return " ".join(f"{n}{d}" for n, d in (("cp", c), ("ep", e)) if n in axes)
    for shape, _why in space.dropped:
        if shape.pp > 1:
            whys.setdefault(shape.pp, {})  # a degree no tensor-parallel degree divides the world with
    for shape in space.piped:
        why_pp = whys.setdefault(shape.pp, {})
        counts = None
        if fixed is not None:
            counts, why = fixed.counts(shape)
            if not counts:
                why_pp[shape.tp] = why
                continue
        runs.append(shape)
        top, mine, why = search_pipeline_degree(graph, psim if fixed is None else fixed.sim_for(shape.cp), mesh,
                                                layout, shape=shape, spec=space.tp_spec,
                                                memory_budget=memory_budget, counts=counts, refine=refine)
        scored += mine
        why_pp[shape.tp if shape.cp == shape.ep == 1 else f"{shape.tp} {named(shape.cp, shape.ep)}"] = why
        if top is None:
            none_axis[(shape.pp, shape.cp, shape.ep)] = why.split(" (")[0]
            continue
        for table, key in ((best, shape.pp), (by_axis, (shape.pp, shape.cp, shape.ep))):
            if key not in table or compared_step(top, fixed is None) < compared_step(table[key], fixed is None):
                table[key] = top
    for pp, why_pp in whys.items():
        if pp not in best:
            tried[pp] = _why_none(why_pp, [s for s in scored if s.plan.mesh.pp_size == pp])
    if fixed is not None and not runs and one_units is not None:
        near = fixed.nearest(list(space.piped), one_units)
        raise OptionError(f"--global-batch {fixed.global_batch}: no degree can run it ("
                          + "; ".join(f"pp{d}: {why}" for d, why in sorted(tried.items()))
                          + f"); global batches that work: {' and '.join(map(str, near)) or 'none'}")
    ref = torchtitan_plan(graph, psim, mesh, layout, space.tp_spec, memory_budget,
                          fixed=fixed) if space.tp_spec is not None else None
    out = combine(flat.result if flat is not None else None, best, tried, scored, ref, memory_budget,
                  tuple(graph.blocks), per_token=fixed is None)
    if len({k[1:] for k in {**none_axis, **by_axis}}) > 1:  # what each cp or ep degree made of each pipeline degree
        tokens = "cp" in axes and fixed is None  # at a global batch every shape runs the same sequences
        work = partial(compared_step, per_token=fixed is None)
        said = "; ".join(f"pp{p} {named(c, e)}: " + (none_axis[p, c, e] if s is None else "its best"
                                                      if s is best.get(p) else f"{work(s) / work(best[p]):.2f}x the "
                                                      + ("time per token" if tokens else "step"))
                         for (p, c, e), s in sorted({**dict.fromkeys(none_axis), **by_axis}.items()))
        what = " and ".join({"cp": "context", "ep": "expert"}[n] for n in axes) + " parallel in the pipeline" + (
            " (per token)" if tokens else "")
        out = replace(out, notes=(*out.notes, f"{what}: {said}"))
    return out
