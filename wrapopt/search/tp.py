"""2-D search: the tensor-parallel degree chosen together with the FSDP plan.

[Note: 2-D search] Each flat shape (``--tp auto``: degree 1 and every degree
``wrapopt.tp.tp_degrees`` accepts) gets the whole 1-D search (``search_shape``:
baselines, the exact DP on every shard group with HSDP, uniform groupings, the
study) on its data-parallel mesh with its cost view, one tensor-parallel rank's
model (``Simulator.view``, See [Note: tensor parallel costs] in cost/tp.py), at
the same global batch. Its plans are lifted onto the full mesh
(``MeshSpec.with_tp``, ``PlanSpec.tp``), and ``combine_tp`` keeps the smallest
degree within the simulator's error of the fastest (See [Note: plans within the
error]; the Optuna study's trials are shared out over the degrees); so units,
reshard, checkpointing, HSDP and the degree are chosen jointly, each degree's
answer being exact under the DP's chain model as in 1-D. A fixed global batch
searches each split's shape the same way (search/batch.py). Beside the answer
the result keeps, for the report, the best plan of every degree and TorchTitan's default:
the largest degree (tensor parallelism across the node), one FSDP unit per
block, every block checkpointed (full activation checkpointing, as
TorchTitan's Llama training configs run; its selective, per-op checkpointing
is not in wrapopt's space).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError, PlanError
from wrapopt.search.choose import STEP_ERROR
from wrapopt.search.driver import SearchResult, search_plan
from wrapopt.search.strategy import Scored, SearchOptions
from wrapopt.spec import AUTO, MeshSpec, ModelGraph, ParallelRequest, PlanSpec, Shape
from wrapopt.tp import TPSpec, builtin_tp_plan, check_tp

__all__ = ["TORCHTITAN_LABEL", "dp_mesh", "lift_plan", "resolve_tp", "search_tp", "search_shape", "combine_tp",
           "auto_degrees", "current_tp_spec", "request_spec"]

TORCHTITAN_LABEL = "TorchTitan default"


def lift_plan(plan: PlanSpec, size: int, spec: TPSpec | None) -> PlanSpec:
    """A plan of the data-parallel mesh as the 2-D plan of degree ``size``."""
    if size == 1:
        return plan
    return replace(plan, mesh=plan.mesh.with_tp(size), tp=spec,
                   label=f"{plan.label} + tp{size}" if plan.label else f"tp{size}")


def _lift_result(res: SearchResult, size: int, spec: TPSpec | None) -> SearchResult:
    return res if size == 1 else res.lifted(lambda p: lift_plan(p, size, spec))


def dp_mesh(mesh: MeshSpec, size: int) -> MeshSpec:
    """The data-parallel mesh of ``mesh`` (no tensor parallelism) at degree ``size``: FSDP over it."""
    return MeshSpec(world_size=mesh.world_size // size, ranks_per_node=mesh.ranks_per_node // size,
                    shard_size=mesh.world_size // size)


def _per_degree(options: SearchOptions | None, size: int, count: int) -> SearchOptions | None:
    """The study's trials shared out over the degrees (``trials`` counts them all); a named
    study gets one study per degree in its storage."""
    if options is None or count == 1:
        return options
    name = options.study_name and (options.study_name if size == 1 else f"{options.study_name}-tp{size}")
    return replace(options, trials=-(-options.trials // count), study_name=name)


def search_tp(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, *, spec: TPSpec | None, degrees: Sequence[int],
              memory_budget: float | None = None, max_group: int | None = None,
              options: SearchOptions | None = None,
              dropped: Sequence[tuple[int, str]] = ()) -> SearchResult:
    """The plan over ``degrees`` (See [Note: 2-D search]); ``mesh`` is the whole mesh without
    tensor parallelism (``tp_size == 1``), ``spec`` how blocks are split (needed for any degree
    above 1). ``SearchResult.tp_rows`` holds the comparison rows, ``tp_tried`` what became of
    every degree, the ``dropped`` ones (``auto_degrees``) with the reason."""
    if mesh.tp_size != 1:
        raise ValueError("search_tp takes the mesh without tensor parallelism and the degrees to try")
    results: dict[int, SearchResult] = {}
    failed: dict[int, str] = {}
    for d in degrees:
        try:
            results[d] = search_shape(graph, sim, mesh, Shape(tp=d), spec=spec, memory_budget=memory_budget,
                                      max_group=max_group, options=_per_degree(options, d, len(degrees)))
        except InfeasibleError as e:
            failed[d] = str(e)
    return combine_tp(sim, results, failed, degrees=degrees, dropped=dropped)


def search_shape(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, shape: Shape, *, spec: TPSpec | None,
                 memory_budget: float | None = None, max_group: int | None = None,
                 options: SearchOptions | None = None) -> SearchResult:
    """The 1-D search of one flat shape on its cost view (``Simulator.view``): FSDP over the shape's
    data-parallel ranks, its plans lifted onto ``mesh``, the whole mesh without tensor parallelism.
    ``spec``: how blocks split (needed above degree 1). See [Note: 2-D search]."""
    if shape.tp == 1:
        return search_plan(graph, sim, mesh, memory_budget=memory_budget, max_group=max_group, options=options)
    if spec is None:
        raise ValueError("tensor-parallel degrees above 1 need a TPSpec")
    sub = sim.view(shape, spec)
    dp = dp_mesh(mesh, shape.tp)
    if options is not None and options.shard_sizes:
        options = replace(options, shard_sizes=tuple(s for s in options.shard_sizes if dp.world_size % s == 0) or None)
    res = search_plan(sub.traced, sub, dp, memory_budget=memory_budget, max_group=max_group, options=options)
    return _lift_result(res, shape.tp, spec)


def combine_tp(sim: Simulator, results: dict[int, SearchResult], failed: dict[int, str], *, degrees: Sequence[int],
               dropped: Sequence[tuple[int, str]] = ()) -> SearchResult:
    """The answer over the flat shapes' tensor-parallel degrees (``results``: each degree's lifted
    search; ``failed``: why the others found nothing): the smallest degree within the simulator's
    error of the fastest, with the report's rows (each degree's best and TorchTitan's default)."""
    if not results:
        raise InfeasibleError(failed.get(1) or next(iter(failed.values())))
    # The smallest degree within the simulator's error of the fastest: See [Note: plans within the error].
    top = min(r.best.estimate.step_s for r in results.values())
    chosen = min(d for d in results if results[d].best.estimate.step_s <= top * (1 + STEP_ERROR))
    out = results[chosen]
    rows: list[tuple[str, Scored]] = []
    if 1 in results:
        rows.append(("best 1-D", results[1].best))
    for d in sorted(results):
        if d > 1:
            rows.append((f"best tp{d}", results[d].best))
    top = max(degrees)
    if top > 1 and top in results:
        per_block = results[top].baselines.get("per-block")
        if per_block is not None:  # with full activation checkpointing, as TorchTitan's Llama configs train
            units = tuple(u if u.is_root else replace(u, reshard_after_forward=True, checkpoint=True)
                          for u in per_block.plan.units)
            plan = replace(per_block.plan, units=units, label=f"per-block,ckpt + tp{top}")
            est = sim.simulate(plan)
            limit = results[top].memory_budget
            rows.append((f"{TORCHTITAN_LABEL} (tp{top}, one unit per block, checkpointed)",
                         Scored(plan, est, est.peak_bytes <= limit, strategy="reference")))
    notes = out.notes + tuple(f"tp{d}: {msg}" for d, msg in sorted(failed.items()))
    return replace(out, notes=notes, tp_rows=tuple(rows), tp_chosen=chosen,
                   tp_tried=_tried(results, chosen, failed, dropped))


def _tried(results: dict[int, SearchResult], chosen: int, failed: dict[int, str],
           dropped: Sequence[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    """Per degree, in order: chosen, how much slower it is, why nothing fitted, or why it was dropped."""
    ref = results[chosen].best.estimate.step_s
    out = dict(dropped)
    for d, msg in failed.items():
        out[d] = "nothing fits: " + msg.split(":")[0]
    for d, r in results.items():
        ratio = r.best.estimate.step_s / ref
        out[d] = ("chosen" if d == chosen else
                  f"fits, {ratio:.2f}x slower" if ratio >= 1 else
                  f"fits, {1 / ratio:.3f}x faster, within the simulator's {STEP_ERROR * 100:.1f}% error")
    return tuple(sorted(out.items()))


def request_spec(graph: ModelGraph, request: ParallelRequest) -> TPSpec:
    """The request's TPSpec (its own, or the recognised one: ``PlanError`` naming the block when
    none is) with the request's sequence-parallel, loss-parallel and async switches; async "auto"
    stays off here (``cost.tp.with_async`` turns it on where the GPU runs it)."""
    spec = request.tp_plan or builtin_tp_plan(graph)
    return replace(spec, sequence_parallel=request.sequence_parallel, loss_parallel=request.loss_parallel,
                   async_tp=request.async_tp is True and request.sequence_parallel)


def current_tp_spec(graph: ModelGraph, request: ParallelRequest) -> TPSpec | None:
    """The TPSpec a described configuration (``--current ... tp N``) runs with: the request's, async
    only when asked outright (TorchTitan's default is off); None when no block can be split (the
    description's ``tp N`` then fails naming the block)."""
    try:
        return request_spec(graph, request)
    except PlanError:
        return request.tp_plan


def auto_degrees(graph: ModelGraph, mesh: MeshSpec, tp_plan: TPSpec | None = None,
                 ) -> tuple[tuple[int, ...], TPSpec | None, tuple[tuple[int, str], ...]]:
    """What ``--tp auto`` tries: (the degrees, the TPSpec, (degree, why dropped) for the others).
    The candidates are 1 and every power of two dividing the ranks per node and the world."""
    cands = [d for d in (2, 4, 8, 16) if mesh.ranks_per_node % d == 0 and mesh.world_size % d == 0]
    try:
        spec = tp_plan or builtin_tp_plan(graph)
    except PlanError as e:
        return (1,), None, tuple((d, f"dropped: no block wrapopt can split: {e}") for d in cands)
    kept, dropped = [1], []
    for d in cands:
        try:
            check_tp(graph, spec, d)
            kept.append(d)
        except PlanError as e:
            why = str(e).split("; use --tp")[0].removeprefix(f"tensor-parallel degree {d} ")
            dropped.append((d, "dropped: " + why))
    return tuple(kept), spec, tuple(dropped)


def resolve_tp(graph: ModelGraph, request: ParallelRequest) -> tuple[tuple[int, ...], TPSpec | None, list[str]]:
    """(degrees to search, the TPSpec, notes) for the request's tensor-parallel degree (its
    syntax and the mesh checked by the request). A degree the model cannot take raises
    ``PlanError`` naming the module and what to pass; "auto" on a model wrapopt cannot split
    searches FSDP alone and says why."""
    mesh, tp = request.mesh, request.tp
    if tp == 1:
        return (1,), None, []
    if tp == AUTO:
        try:
            spec = request_spec(graph, request)
        except PlanError as e:
            return (1,), None, [f"--tp auto: tensor parallelism not tried: {e}"]
        degrees, spec, _dropped = auto_degrees(graph, mesh, spec)
        return degrees, spec, [] if len(degrees) > 1 else [
            f"--tp auto: no degree above 1 divides the {mesh.ranks_per_node} ranks per node "
            "and every attention's heads"]
    spec = request_spec(graph, request)
    check_tp(graph, spec, tp)
    return (tp,), spec, []
