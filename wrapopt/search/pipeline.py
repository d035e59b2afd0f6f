"""3-D search: the pipeline degree, its stages, schedule and micro-batches, chosen with the FSDP plan.

[Note: pipeline search] For each pipeline degree asked for (``--pp auto``: 1 and 2, 4, 8, 16
where they divide the world and leave every stage a block), and each tensor-parallel degree:

- degree 1 is the search without a pipeline (``search_plan`` / ``search_tp``, [Note: 2-D search]);
- above 1, on the mesh ``pp x (world / (pp x tp)) x tp`` with FSDP over each stage's
  data-parallel ranks: the virtual stages per rank (1 for GPipe and 1F1B; 2 and 4 for
  Interleaved1F1B), each giving a balanced split ([Note: stage split]); the schedule; the
  micro-batches ``m`` (``pp``, 2, 4 and 8 times ``pp`` where they divide the pipeline's batch:
  ``pp x tp`` ranks' batches at the same global batch); and the FSDP shape, one for every stage:
  one unit per block (the end modules in each stage's root), resharded after forward or not,
  and no, every other, or every block checkpointed. Two passes keep it small: every (virtual
  stages, schedule, micro-batches) with the fastest and the smallest shape, then every shape on
  the three best of those. The shape is shared by the stages in those passes, not searched per
  stage: a pipeline plan is scored by simulating each of its stages, and the DP per stage for
  every micro-batch count and schedule would multiply the search's time. Then a third pass
  searches each stage's FSDP plan apart (the 1-D ``search_plan``, the exact DP included, on the
  stage's simulator) for the ``REFINE_TOP`` fastest plans that fit, and keeps the result only
  where it fits and beats the shared shape by more than the simulator's error: See [Note:
  per-stage refinement] in search/pipeline_stages.py.

At a fixed global batch (``--global-batch N``) degree 1 is the global-batch search and the
micro-batch counts and sizes follow N rather than the traced batch per rank: See [Note: pipeline
global batch] in search/pipeline_batch.py.

Plans are scored by ``Simulator.simulate`` ([Note: pipeline stages]); the smallest pipeline
degree within the simulator's error of the fastest wins (as tensor-parallel degrees do), and
``SearchResult.pp_rows`` keeps the best plan of every degree for the report, with TorchTitan's
405B layout (tp 8, pp 8, Interleaved1F1B with 2 stages per rank, micro-batches of one
sequence, one unit per block kept unsharded after forward as TorchTitan does under pipelining,
every block checkpointed) when the mesh has it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Sequence

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError, PlanError
from wrapopt.fileio import fmt_bytes
from wrapopt.search.choose import MEMORY_ERROR, STEP_ERROR
from wrapopt.search.driver import SearchResult
from wrapopt.search.pipeline_batch import PipelineBatch, pipeline_at_batch, pipeline_batch
from wrapopt.search.pipeline_stages import REFINE_TOP, refine_stages, refined_over
from wrapopt.search.stages import (PipelineLayout, balanced_split, check_stage_count, pipeline_layout,
                                   stage_modules, weights)
from wrapopt.search.strategy import Scored, compared_step
from wrapopt.spec import AUTO, ROOT, MeshSpec, ModelGraph, ParallelRequest, PlanSpec, Shape, UnitSpec
from wrapopt.spec.plan import PipelineSpec
from wrapopt.tp import TPSpec
from wrapopt.train import TrainConfig

__all__ = ["AUTO_PP", "VIRTUAL_STAGES", "CHECKPOINTS", "TORCHTITAN_PP_LABEL", "resolve_pp", "pipeline_plan",
           "search_pipeline_degree", "combine", "microbatch_counts", "pipeline_sequences", "torchtitan_plan",
           "pipeline_for", "pipeline_estimate", "pp_group_sizes"]

AUTO_PP = (2, 4, 8, 16)  # pipeline degrees --pp auto tries (with 1)
VIRTUAL_STAGES = (2, 4)  # stages per rank tried for Interleaved1F1B
CHECKPOINTS = ("none", "half", "all")  # which blocks of each stage are checkpointed
TORCHTITAN_PP_LABEL = "TorchTitan 405B layout"
_REFINE = 3  # (virtual stages, schedule, micro-batches) that get every shape


@dataclass(frozen=True, slots=True)
class _StageFsdp:
    """The FSDP choice every stage shares."""

    reshard: bool
    checkpoint: str  # one of CHECKPOINTS


def resolve_pp(graph: ModelGraph, request: ParallelRequest,
               ) -> tuple[tuple[int, ...], PipelineLayout | None, list[str]]:
    """(degrees, the model's pipeline layout, notes) for the request's pipeline degree (its syntax
    and the world checked by the request). A forced degree the model cannot take raises
    ``PlanError`` saying what works; "auto" on a model that cannot be pipelined searches degree 1
    and says why."""
    mesh, pp = request.mesh, request.pp
    if pp == 1:
        return (1,), None, []
    if pp == AUTO:
        try:
            layout = pipeline_layout(graph)
        except PlanError as e:
            return (1,), None, [f"--pp auto: pipelining not tried: {e}"]
        n = len(layout.blocks)
        return (1, *(d for d in AUTO_PP if mesh.world_size % d == 0 and d <= n)), layout, []
    layout = pipeline_layout(graph)
    check_stage_count(layout, pp, 1, mesh.world_size)
    return (pp,), layout, []


def pp_group_sizes(request: ParallelRequest, *, also: Sequence[int] = ()) -> tuple[int, ...]:
    """The groups of consecutive ranks a measured fabric needs for the request's pipeline degree,
    with the sizes in ``also`` (tensor-parallel groups; 1 is dropped), sorted: See [Note: pipeline
    fabric]."""
    sizes = {d for d in also if d >= 2}
    world, ranks_per_node = request.mesh.world_size, request.mesh.ranks_per_node
    degrees = AUTO_PP if request.pp == AUTO else (request.pp,)
    for d in degrees:
        stage = world // d
        if d < 2 or world % d or stage >= ranks_per_node:
            continue  # stages of whole nodes: the intra, inter and world axes price them
        sizes.update(x for x in (stage, 2) if x >= 2 and ranks_per_node % x == 0)
    return tuple(sorted(sizes))


# [Note: pipeline fabric] Pipeline stages are consecutive ranks (the pipeline axis is the mesh's
# outermost), so a stage inside a node is a group of ``world / pp`` consecutive ranks: its FSDP
# collectives run on that group, all stages at once, and neighbouring stages' sends cross a link
# inside the node. A measured fabric has only the world axis on one node (intra and inter across
# nodes), and ``FabricProfile.collective_s`` rescales any other group from the nearest axis with
# the ring model, never below that axis's latency: a stage's smaller group and every send would be
# priced at the world's latency, well above what a small group takes. So wherever wrapopt measures
# the fabric for a pipeline search (``optimize_wrap(pp=...)`` under a process group, ``wrapopt
# profile-fabric --pp``, the fidelity bench), it also measures groups of each tried degree's stage
# size, and of 2 (the sends, priced as a 2-rank all-gather by ``cost.pipeline.send_s``), inside a node.


def pipeline_sequences(graph: ModelGraph, pp: int, tp: int, accumulation: int = 1) -> int:
    """A pipeline's batch at the search's local batch (sequences per step): ``pp x tp x accumulation``
    ranks' traced batches, at the same global batch as a plan without a pipeline."""
    return max(1, graph.batch_size) * pp * tp * max(1, accumulation)


def microbatch_counts(graph: ModelGraph, shape: Shape) -> tuple[int, ...]:
    """Micro-batch counts tried: ``pp`` x 1, 2, 4, 8 where they divide the pipeline's batch
    (``pipeline_sequences``)."""
    pp = shape.pp
    batch = pipeline_sequences(graph, pp, shape.tp, shape.accumulation)
    return tuple(k * pp for k in (1, 2, 4, 8) if batch % (k * pp) == 0)


def pipeline_plan(layout: PipelineLayout, sizes: tuple[int, ...], mesh: MeshSpec, *, schedule: str,
                  microbatches: int, reshard: bool, checkpoint: str, tp_spec: TPSpec | None,
                  label: str = "") -> PlanSpec:
    """One unit per block on every stage (``checkpoint``: none, every other block of a stage, all)."""
    stages = stage_modules(layout, sizes)
    units, at = [], 0
    for k in sizes:
        for i, b in enumerate(layout.blocks[at:at + k]):
            ck = checkpoint == "all" or (checkpoint == "half" and i % 2 == 0)
            units.append(UnitSpec((b,), reshard, ck))
        at += k
    units.append(UnitSpec((ROOT,), False))
    return PlanSpec(units=tuple(units), mesh=mesh, tp=tp_spec, label=label,
                    pipeline=PipelineSpec(stages=stages, schedule=schedule, microbatches=microbatches))


def _mesh(mesh: MeshSpec, shape: Shape) -> MeshSpec:
    """``shape`` on the world of ``mesh``: FSDP over each stage's data-parallel ranks (``dp_shard x cp``),
    the experts over ``ep`` of them."""
    return MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node,
                    shard_size=shape.dp(mesh.world_size) * shape.cp, tp_size=shape.tp, pp_size=shape.pp,
                    cp_size=shape.cp, ep_size=shape.ep)


def _label(schedule: str, virtual: int, m: int, fsdp: _StageFsdp, shape: Shape) -> str:
    v = f" x{virtual}" if virtual > 1 else ""
    ck = {"none": "", "half": ",ckpt-half", "all": ",ckpt"}[fsdp.checkpoint]
    axes = "".join(f" + {n}{d}" for n, d in (("tp", shape.tp), ("cp", shape.cp), ("ep", shape.ep)) if d > 1)
    return f"per-block{'' if fsdp.reshard else ',keep'}{ck} + pp{shape.pp} {schedule}{v} m{m}{axes}"


def search_pipeline_degree(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, layout: PipelineLayout, *,
                           shape: Shape, spec: TPSpec | None, memory_budget: float | None,
                           fsdp: Sequence[_StageFsdp] | None = None,
                           counts: Sequence[int] | None = None,
                           refine: bool = True) -> tuple[Scored | None, list[Scored], str]:
    """The fastest plan of ``shape`` (its pipeline and tensor-parallel degrees; None: none fits),
    every plan scored, and what became of the shape. ``fsdp``: the stages' FSDP shape, kept
    (default: searched). ``counts``: the micro-batch counts to try (default ``microbatch_counts``;
    at a fixed global batch, [Note: pipeline global batch] in search/pipeline_batch.py). See
    [Note: pipeline search]."""
    pp, tp = shape.pp, shape.tp
    budget = float(memory_budget) if memory_budget else float("inf")
    aim = budget * (1 - MEMORY_ERROR)
    ms = tuple(counts) if counts is not None else microbatch_counts(
        graph, replace(shape, accumulation=sim.options.grad_accumulation))
    if not ms:
        return None, [], (f"dropped: the pipeline's batch of {pipeline_sequences(graph, pp, tp)} sequences is "
                          f"smaller than its {pp} stages (at least one micro-batch per stage)")
    full = _mesh(mesh, shape)
    # under cp or ep: one such rank's share (See [Note: cp in a pipeline] and [Note: ep in a pipeline])
    wsim = sim.view(Shape(tp=tp, cp=shape.cp, ep=shape.ep), spec)
    w, first, last = weights(graph, wsim, full.data_parallel(), layout)
    combos = []
    for v in (1, *VIRTUAL_STAGES):
        if pp * v > len(layout.blocks):
            continue
        sizes = balanced_split(w, first, last, pp * v)
        for schedule in (("GPipe", "1F1B") if v == 1 else ("Interleaved1F1B",)):
            combos += [(sizes, schedule, v, m) for m in ms if schedule != "Interleaved1F1B" or m % max(1, m // pp) == 0]
    scored: list[Scored] = []

    def score(combo: tuple, stage: _StageFsdp) -> Scored:
        sizes, schedule, v, m = combo
        plan = pipeline_plan(layout, sizes, full, schedule=schedule, microbatches=m, reshard=stage.reshard,
                             checkpoint=stage.checkpoint, tp_spec=spec if tp > 1 else None,
                             label=_label(schedule, v, m, stage, shape))
        est = sim.simulate(plan)
        s = Scored(plan, est, est.peak_bytes <= budget, strategy="pipeline")
        scored.append(s)
        return s

    screen = tuple(fsdp) if fsdp else (_StageFsdp(False, "none"), _StageFsdp(True, "all"))
    firsts = {c: [score(c, sh) for sh in screen] for c in combos}
    rank = sorted(combos, key=lambda c: min((s.estimate.step_s if s.estimate.peak_bytes <= aim else float("inf"),
                                             s.estimate.peak_bytes) for s in firsts[c]))
    for c in rank[:0 if fsdp else _REFINE]:
        for stage in (_StageFsdp(r, k) for r in (False, True) for k in CHECKPOINTS):
            if stage not in screen:
                score(c, stage)
    # within the memory model's error of the budget; else any that fits it (See [Note: plans within the error])
    fitting = [s for s in scored if s.estimate.peak_bytes <= aim] or [s for s in scored if s.fits]
    if not fitting:
        small = min(scored, key=lambda s: s.estimate.peak_bytes)
        return None, scored, (f"nothing fits: the smallest peak is {fmt_bytes(small.estimate.peak_bytes)} "
                              f"({small.plan.label})")
    top = sorted(fitting, key=lambda s: (s.estimate.step_s, s.estimate.peak_bytes))
    if fsdp or not refine:  # an FSDP shape given (``pipeline_for``), or one runtime shape: kept on every stage
        return top[0], scored, "fits"
    refined = [r for r in (refine_stages(sim, s, memory_budget=memory_budget) for s in top[:REFINE_TOP]) if r]
    scored += refined
    return refined_over(top[0], refined, memory_budget=memory_budget), scored, "fits"


def pipeline_for(graph: ModelGraph, sim: Simulator, plan: PlanSpec, request: ParallelRequest, *,
                 memory_budget: float | None, fixed: PipelineBatch | None = None) -> tuple[PlanSpec, list[str]]:
    """``plan`` (one unit per block) on a pipeline of the request's degree (an int or "auto"): its
    stages, schedule and micro-batches chosen as the search does, its FSDP shape kept (for
    ``wrapopt estimate --pp``); ``fixed``: at that global batch ([Note: pipeline global batch] in
    search/pipeline_batch.py). Raises ``PlanError`` for a plan or degree that cannot be pipelined."""
    mesh = plan.mesh
    base = MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=mesh.world_size)
    degrees, layout, notes = resolve_pp(graph, replace(request, mesh=base))
    if layout is None or degrees == (1,):
        return plan, notes
    blocks = [u for u in plan.units if not u.is_root]
    if sorted(m for u in blocks for m in u.modules) != sorted(layout.blocks) or any(len(u.modules) > 1 for u in blocks):
        raise PlanError(f"--pp takes a plan of one unit per block (--plan per-block); {plan.label or 'this plan'} "
                        "has other units")
    cks = [u.checkpoint for u in blocks]
    kept = _StageFsdp(blocks[0].reshard_after_forward is not False,
                      "all" if all(cks) else "half" if any(cks) else "none")
    found = {}
    for d in degrees:  # the plan's cp and ep degrees kept: See [Note: cp in a pipeline] in search/shapes.py
        shape = Shape(pp=d, tp=mesh.tp_size, cp=mesh.cp_size, ep=mesh.ep_size)
        if d > 1 and shape.misfit(mesh.world_size):
            notes.append(f"pp{d}: {shape.misfit(mesh.world_size)}")
        elif d > 1:
            counts, why = fixed.counts(shape) if fixed is not None else (None, "")
            if counts == ():
                notes.append(f"pp{d}: {why}")
                continue
            top, _all, why = search_pipeline_degree(graph, fixed.sim_for(shape.cp) if fixed is not None else sim,
                                                    base, layout,
                                                    shape=shape, spec=plan.tp, memory_budget=memory_budget,
                                                    fsdp=(kept,), counts=counts)
            if top is not None:
                found[d] = top
            else:
                notes.append(f"pp{d}: {why}")
    if not found:
        raise PlanError("no pipeline degree fits: " + "; ".join(notes))
    best = min(found.values(), key=lambda s: s.estimate.step_s)
    return best.plan, notes


def pipeline_estimate(graph: ModelGraph, sim: Simulator, plan: PlanSpec, request: ParallelRequest, *,
                      memory_budget: float | None) -> tuple[PlanSpec, Simulator, TrainConfig, list[str]]:
    """``wrapopt estimate``'s plan, simulator, training step and notes: ``plan`` put on a pipeline
    of the request's degree when one is asked (``pipeline_for``), and a pipeline plan priced at the
    request's global batch when one is fixed ([Note: pipeline global batch] in
    search/pipeline_batch.py); else ``plan``, ``sim`` and the request's step as given."""
    notes: list[str] = []
    train = request.train
    if request.asks_pp and plan.pipeline is None:
        fixed = None if request.global_batch is None else pipeline_batch(
            graph, sim, replace(request, mesh=_world_mesh(plan.mesh)), memory_budget=memory_budget)
        plan, notes = pipeline_for(graph, sim, plan, request, memory_budget=memory_budget, fixed=fixed)
    if request.global_batch is not None and plan.pipeline is not None:
        sim, train = pipeline_at_batch(graph, sim, plan, replace(request, mesh=_world_mesh(plan.mesh)),
                                       memory_budget=memory_budget)
    return plan, sim, train, notes


def _world_mesh(mesh: MeshSpec) -> MeshSpec:
    """FSDP over the whole world of ``mesh`` (the world size is all the pipeline batch reads)."""
    return MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=mesh.world_size)


def torchtitan_plan(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, layout: PipelineLayout,
                    spec: TPSpec | None, memory_budget: float | None, *,
                    fixed: PipelineBatch | None = None) -> Scored | None:
    """TorchTitan's 405B layout on ``mesh`` (None when the mesh or the model cannot take it), in
    micro-batches of one sequence (``fixed``: of its global batch, ``sim`` pricing it as [Note:
    pipeline global batch] in search/pipeline_batch.py says). See [Note: pipeline search]."""
    pp, tp, v = 8, 8, 2
    global_batch = fixed.global_batch if fixed is not None else None
    if spec is None or mesh.ranks_per_node % tp or mesh.world_size % (pp * tp) or pp * v > len(layout.blocks):
        return None
    dp = mesh.world_size // (pp * tp)
    if global_batch is None:
        m = pp * tp * max(1, graph.batch_size) * sim.options.grad_accumulation  # micro-batches of one sequence
    elif global_batch % dp == 0:
        m = global_batch // dp
    else:
        return None
    if m < pp or m % pp or m % max(1, m // pp):  # as the search's counts; Interleaved1F1B's rounds
        return None
    full = _mesh(mesh, Shape(pp=pp, tp=tp))
    w, first, last = weights(graph, sim.view(Shape(tp=tp), spec), full.data_parallel(), layout)
    plan = pipeline_plan(layout, balanced_split(w, first, last, pp * v), full, schedule="Interleaved1F1B",
                         microbatches=m, reshard=False, checkpoint="all", tp_spec=spec,
                         label=f"{TORCHTITAN_PP_LABEL}: tp8 pp8 Interleaved1F1B x2 m{m}, per-block,keep,ckpt")
    est = sim.simulate(plan)
    budget = float(memory_budget) if memory_budget else float("inf")
    return Scored(plan, est, est.peak_bytes <= budget, strategy="reference")


def combine(one_d: SearchResult | None, per_degree: dict[int, Scored], tried: dict[int, str],
            scored: Sequence[Scored], reference: Scored | None, memory_budget: float | None,
            blocks: tuple[str, ...] = (), per_token: bool = True) -> SearchResult:
    """The answer over the pipeline degrees: the smallest degree within the simulator's error of
    the fastest (degree 1's from its own search), with the rows the report prints. ``per_token``:
    compared per token (cp rows run 1/cp of the tokens), else by the step (at a fixed global batch
    every row runs the same sequences)."""
    best = dict(per_degree)
    if one_d is not None:
        best[1] = one_d.best
    aim = (float(memory_budget) if memory_budget else float("inf")) * (1 - MEMORY_ERROR)
    within = {d: s for d, s in best.items() if s.estimate.peak_bytes <= aim}
    if within and len(within) < len(best):  # See [Note: plans within the error]: the margin first
        for d in set(best) - set(within):
            tried[d] = (f"fits only past the memory model's {MEMORY_ERROR * 100:.0f}% margin "
                        f"({best[d].estimate.peak_bytes / 2**30:.2f} GiB, {best[d].plan.label})")
        rows_extra = {d: best[d] for d in set(best) - set(within)}
        best = within
    else:
        rows_extra = {}
    if not best:
        raise InfeasibleError("no pipeline degree has a plan that fits: " + "; ".join(
            f"pp{d}: {why}" for d, why in sorted(tried.items())))
    work = partial(compared_step, per_token=per_token)  # See [Note: pipeline global batch]
    top = min(work(s) for s in best.values())
    chosen = min(d for d, s in best.items() if work(s) <= top * (1 + STEP_ERROR))
    shown = {**best, **rows_extra}
    rows = [(f"best pp{d}" + (" (no pipeline)" if d == 1 else ""), shown[d]) for d in sorted(shown)]
    if reference is not None:
        rows.append((reference.plan.label, reference))
    ref = work(best[chosen])
    out_tried = dict(tried)
    for d, s in best.items():
        r = work(s) / ref
        out_tried[d] = "chosen" if d == chosen else (f"fits, {r:.2f}x slower" if r >= 1 else
                                                     f"fits, {1 / r:.3f}x faster, within the simulator's "
                                                     f"{STEP_ERROR * 100:.1f}% error")
    pp_tried = tuple(sorted(out_tried.items()))
    tokens = per_token and any(s.plan.mesh.cp_size > 1 for s in shown.values())  # the report's rows say so
    if chosen == 1 and one_d is not None:
        return replace(one_d, pp_rows=tuple(rows), pp_tried=pp_tried, pp_per_token=tokens)
    win = best[chosen]
    if one_d is not None:
        why = (f"pipeline degree {chosen}: {work(one_d.best) / work(win):.2f}x faster than the best plan without "
               "a pipeline" + (" (per token)" if per_token and win.plan.mesh.cp_size != one_d.best.plan.mesh.cp_size
                               else ""))
    else:
        why = f"pipeline degree {chosen}: " + ("no plan without a pipeline fits" if 1 in tried else "as asked (--pp)")
    budget = float(memory_budget) if memory_budget else float("inf")
    if one_d is not None:
        return replace(one_d, best=win, fastest=win, why=why, candidates=one_d.candidates + tuple(scored),
                       pp_rows=tuple(rows), pp_tried=pp_tried, tp_rows=(), pp_per_token=tokens)
    return SearchResult(best=win, baselines={}, candidates=tuple(scored), memory_budget=budget, fastest=win, why=why,
                        pp_rows=tuple(rows), pp_tried=pp_tried, blocks=blocks, pp_per_token=tokens)
