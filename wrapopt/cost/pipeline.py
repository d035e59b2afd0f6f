"""A pipeline plan's step: each stage's FSDP step, per micro-batch, run in the order torch's
pipeline schedule runs them. The order and its run are ``pipeline_schedule.py``; this module
prices the stages and composes the step.

[Note: pipeline stages] A plan with ``mesh.pp_size = p > 1`` splits the model into stages
(``PipelineSpec.stages``; with ``k`` virtual stages per rank, ``k * p`` of them, stage ``s`` on
pipeline rank ``s % p``). Every stage runs FSDP on its own ranks (``mesh.stage_mesh()``, less
the tensor-parallel axis: ``mesh.data_parallel()``). At the same global batch as a plan without
a pipeline, one pipeline (``p`` ranks, each a tensor-parallel group of ``tp``) runs ``p`` ranks'
batches (times the accumulation), split into ``m`` micro-batches (``PipelineSpec.microbatches``).

*One stage*: the ordinary step simulator on the stage alone (``Simulator.for_stage``: the
stage's sub-graph, ``cost/stage_view.py``), one micro-batch, with the sync mode torch's
``PipelineStage`` uses under FSDP2: every micro-batch's backward runs with
``set_requires_gradient_sync(False)`` (unsharded gradients accumulate over the micro-batches:
the simulator's ``accumulation_sync="last"`` memory), and the gradient reduction runs once,
after the stage's last backward (torch's ``REDUCE_GRAD`` action: ``post_backward`` of every
group, reduce-scatters then the replicate all-reduce, awaited before the next action). From
that one run (``stage_cost``):

- forward of a micro-batch ``fwd_s``: the forward compute (the loss on the last stage) plus the
  exposed all-gathers of the units resharded after forward, which gather again every
  micro-batch; the units kept unsharded (``reshard_after_forward=False``, the root) gather on
  the first micro-batch only (``first_extra_s``) and stay gathered the whole step;
- backward of a micro-batch ``bwd_s``: the simulator's backward (re-gathers included) less its
  reduce-scatters (no gradient sync until REDUCE_GRAD), at least its compute and recompute;
- ``reduce_s``: the gradient reduction, serial (the REDUCE_GRAD action), and the optimizer step;
- memory: ``static_bytes`` (sharded parameters, optimizer state, the unsharded gradients held
  across micro-batches), ``kept_bytes`` (parameters kept unsharded the whole step),
  ``activation_bytes`` (what one micro-batch in flight keeps from its forward to its backward:
  each unit's saved activations, a checkpointed unit's input, the loss's saved bytes) and
  ``transient_bytes`` (the rest of the simulator's peak: gathered units, a checkpointed block's
  recomputed activations, the working set).

*Units gathered across actions*: torch 2.13's stage also turns off ``reshard_after_backward``
until the last backward, so the parameters a backward gathered stay gathered until the stage's
next forward reshards them. ``run_timeline`` keeps that state per stage: a forward right after
the stage's backward (1F1B's steady state) runs without its all-gathers (``fwd_gathered_s``),
and a backward right after the stage's backward (GPipe's backwards after the first) without its
re-gathers (``bwd_gathered_s``). So 1F1B gathers once per micro-batch (in backward), GPipe
``m + 1`` times in all, not ``2m``. *The memory of units held*: from a backward to the stage's
next forward (or its REDUCE_GRAD, whose ``post_backward`` reshards) the stage holds its resharded
units' parameters gathered (``gathered_bytes``; the kept units are in ``kept_bytes`` already).
``held_moment`` walks a rank's order and, at the start of each forward and backward while some of
its stages hold units, adds the activations in flight then (a forward's own not yet, a backward's
own still), the held parameters, and the acting stage's transient, less the parameters that
transient gathers (``transient_gathered_bytes``: the estimate's gathered parameters at its peak
less the kept ones) when they are among those held. The rank's peak is the larger of that moment
and the bound below. So 1F1B with resharding peaks, where the stage's parameters outweigh a
micro-batch's activations, just before a forward that follows a backward (all its units
gathered, the other micro-batches' activations held); GPipe's peak can be a backward after
another (its units and the rest of its activations). The moment is a bound: its transient is
the stage's largest over a micro-batch, where a forward's start needs less.

*The schedule*: the per-rank order of forward (F), backward (B) and REDUCE_GRAD actions is
torch's own (``schedule_order``): for Interleaved1F1B the ``pipeline_order`` its runtime
executes (``_calculate_single_rank_operations`` + ``_add_reduce_grad``); for GPipe its
``_get_pipeline_order``; for 1F1B the order its ``_step_microbatches`` runs (``p - r``
forwards on rank ``r``, then one backward and one forward in turn), because its
``_get_pipeline_order`` in torch 2.13 numbers the forwards after the warm-up one too high (the
last rank's list runs F1..Fm, not F0..Fm-1). ``run_timeline`` executes the orders with their
dependencies: F of stage s, micro-batch i, starts after F of stage s-1, micro-batch i, and
the activation's send; B likewise from stage s+1; each rank one action at a time in its order.
A send of B bytes costs the link's latency + B / bandwidth (``send_s``: the fabric's two-rank
all-gather of 2B, which is that on the ring model), inter-node when ``mesh.stages_cross_nodes``.
Peak memory per rank: its stages' static and kept bytes, plus the activations of the
micro-batches in flight at the worst moment of its order (1F1B: at most ``p - r`` on rank r),
plus the largest transient; or, when larger, its worst moment with units held (above). Step: the
makespan (its last action, REDUCE_GRAD included), the tied copies' gradient sum if any, and the
slowest rank's optimizer steps. ``compute_s``: the busiest rank's compute; ``exposed_comm_s``: the rest.

[Note: a stage keeps its output] torch's ``PipelineStage`` keeps each micro-batch's output (and
inputs, which its first module saves anyway) in its ``fwd_cache`` until that micro-batch's backward,
where a plain step frees it once used (cross-entropy saves its log-softmax, not the logits). So a
micro-batch in flight holds its saved activations and the stage's output (``activation_bytes``; the
last stage's: the logits), and the transient is the rest of the plain step's peak, without it
(a tied head's copy: [Note: tied copies on stages] in ``cost/stage_view.py``).

[Note: pipeline actions] torch's schedule does host work for every forward and backward action (the
stage's bookkeeping, receive buffers and point-to-point calls, autograd's call into it), a cost
per micro-batch even when a stage computes nothing. A measured profile carries it per action
(``pipeline_action_s``, ``measure_pipeline_action``: a 1F1B of 2 and of 8 micro-batches on rank
pairs, less the two sends each micro-batch adds, which ``send_s`` charges), and every forward and
backward of a stage pays it. Analytical profiles leave it 0 (host
work a GPU's run-ahead may hide; not measured here).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from wrapopt.cost.estimate import PEAK_PARTS
from wrapopt.cost.pipeline_schedule import StageCost, Timeline, held_moment, run_timeline, schedule_order
from wrapopt.cost.stage_view import stage_of, tied_sync_s
from wrapopt.hardware.profiles import FabricProfile
from wrapopt.spec import CostEstimate, PlanSpec, Shape, SimOptions, TimelineEvent, UnitCost, UnitSpec
from wrapopt.units import ancestors

__all__ = ["StageCost", "Timeline", "schedule_order", "run_timeline", "send_s", "stage_cost", "held_bytes",
           "held_moment", "stage_units", "simulate_pipeline", "stage_options", "stage_simulators", "price_stage",
           "compose_pipeline", "rank_peaks"]


class _StageSimulator(Protocol):  # what this module asks of ``cost.simulate.Simulator``
    options: SimOptions
    fabric: FabricProfile

    def simulate(self, plan: PlanSpec, *, record: bool = False) -> CostEstimate: ...


def send_s(fabric: FabricProfile, nbytes: float, *, cross_nodes: bool) -> float:
    """One point-to-point send of ``nbytes``: latency + bytes / bandwidth of the link (inter-node
    when ``cross_nodes``), priced as the fabric's all-gather of 2 x nbytes over two ranks."""
    if nbytes <= 0:
        return 0.0
    return fabric.collective_s("all_gather", 2, 1 if cross_nodes else 2, 2 * nbytes)[0]


def stage_options(options: SimOptions, pp_size: int, microbatches: int) -> SimOptions:
    """A stage simulator's options: one micro-batch of the pipeline's batch (``pp_size`` ranks'
    batches times the accumulation, split ``microbatches`` ways), gradients held unsynchronised
    over two micro-batches (the sync torch's stage uses): See [Note: pipeline stages]."""
    scale = options.batch_scale * pp_size * options.grad_accumulation / microbatches
    return replace(options, batch_scale=scale, grad_accumulation=2, accumulation_sync="last")


def stage_units(plan: PlanSpec) -> list[tuple[UnitSpec, ...]]:
    """Per stage, its units and the root's (the root unit's choices are each stage root's)."""
    assert plan.pipeline is not None
    owner = plan.pipeline.stage_of()
    per: list[list[UnitSpec]] = [[] for _ in plan.pipeline.stages]
    for u in plan.units[:-1]:
        s = {stage_of(m, owner) for m in u.modules}
        if len(s) != 1 or None in s:
            raise ValueError(f"unit {u.name} is not inside one pipeline stage; each unit's modules must belong to "
                             "one stage (PipelineSpec.stages)")
        per[s.pop()].append(u)
    return [(*units, plan.root) for units in per]


def held_bytes(est: CostEstimate, units: tuple[UnitSpec, ...], kept_inputs: list[float], loss_saved: float) -> float:
    """What one micro-batch keeps from its forward to its backward: per unit its saved activations,
    or what a checkpointed unit keeps (``kept_inputs``, as the step simulator reads a truthy
    ``UnitSpec.checkpoint``), and the loss's saved bytes on the last stage."""
    return sum(k if u.checkpoint else c.saved_bytes for c, u, k in zip(est.units, units, kept_inputs)) + loss_saved


def stage_cost(est: CostEstimate, units: tuple[UnitSpec, ...], *, loss_s: float, send_bytes: float,
               held: float | None = None, action_s: float = 0.0, output_bytes: float = 0.0) -> StageCost:
    """A stage's per-micro-batch figures from its simulator's estimate (accumulation 2, sync
    "last"); ``held``: a micro-batch's activations kept from forward to backward (``held_bytes``;
    None: the activations at the estimate's peak); ``action_s``: the schedule's host work per
    action, on each forward and backward ([Note: pipeline actions]); ``output_bytes``: the stage's
    output, kept beside them ([Note: a stage keeps its output]). See [Note: pipeline stages]."""
    costs = list(est.units)
    gathered = sum(c.param_bytes for c in costs) or 1
    resharded = [u.reshard_after_forward is not False for u in units]
    share = sum(c.param_bytes for c, r in zip(costs, resharded) if r) / gathered
    fwd_compute = sum(c.fwd_s for c in costs) + loss_s
    compute = est.compute_s / 2
    gather_exposed = max(0.0, est.fwd_s - fwd_compute)
    ag = sum(c.all_gather_s for c in costs)
    ag_resharded = sum(c.all_gather_s for c, r in zip(costs, resharded) if r)
    regather = sum(c.all_gather_s for c, u in zip(costs, units) if u.reshard_after_forward is True)
    reduce_s = max(sum(c.reduce_scatter_s for c in costs), est.comm_s - ag - regather)
    parts = dict(est.peak_breakdown)
    static = parts["sharded_params"] + parts["optimizer_state"] + parts["accumulated_grads"]
    kept = sum(c.param_bytes for c, r in zip(costs, resharded) if not r)
    gathered = sum(c.param_bytes for c, r in zip(costs, resharded) if r)
    acts = parts["activations"] if held is None else held
    # A micro-batch's backward runs without gradient sync: the estimate's (synchronising) backward
    # less its reduce-scatters, which run once, in the end-of-step reduction (``reduce_s``); never
    # below the backward's compute and recompute (a micro-batch's compute less its forward).
    floor = max(sum(c.bwd_s for c in costs), compute - fwd_compute)
    bwd = max(floor, est.bwd_s - sum(c.reduce_scatter_s for c in costs))
    return StageCost(fwd_s=fwd_compute + gather_exposed * share + action_s, bwd_s=bwd + action_s,
                     first_extra_s=gather_exposed * (1 - share), reduce_s=reduce_s, optim_s=est.optim_s,
                     static_bytes=static, kept_bytes=kept, activation_bytes=acts + output_bytes,
                     transient_bytes=max(0.0, est.peak_bytes - static - kept - acts), compute_s=compute,
                     mb_comm_s=ag_resharded + regather, once_comm_s=ag - ag_resharded + reduce_s,
                     send_bytes=send_bytes, estimate=est, fwd_gathered_s=fwd_compute + action_s,
                     bwd_gathered_s=floor + action_s,
                     gathered_bytes=gathered,
                     transient_gathered_bytes=min(gathered, max(0.0, parts["unsharded_params"] - kept)))


def stage_simulators(sim: Any, plan: PlanSpec) -> list[tuple[Any, tuple[UnitSpec, ...]]]:
    """Per stage of pipeline ``plan``, its simulator (``Simulator.for_stage`` of the tensor-parallel
    view, one micro-batch: ``stage_options``) and its units (the root's last), as
    ``simulate_pipeline`` prices them. ``sim`` is the model's simulator."""
    pipe, mesh = plan.pipeline, plan.mesh
    assert pipe is not None
    base = sim.view(Shape(tp=mesh.tp_size), plan.tp)
    options = stage_options(base.options, mesh.pp_size, pipe.microbatches)  # the tp view scales its batch
    n = len(pipe.stages)
    return [(base.for_stage(tuple(mods), first=s == 0, last=s == n - 1, options=options), units)
            for s, (mods, units) in enumerate(zip(pipe.stages, stage_units(plan)))]


def price_stage(ssim: Any, units: tuple[UnitSpec, ...], plan: PlanSpec, *, last: bool) -> StageCost:
    """One stage's ``StageCost`` with ``units`` (the root's last) on ``ssim`` (``stage_simulators``)."""
    est = ssim.simulate(PlanSpec(units=units, mesh=plan.mesh.data_parallel(), forward_prefetch=plan.forward_prefetch))
    scale = ssim.options.batch_scale
    out = ssim.graph.root.output_bytes * scale  # the activation sent on; the last stage's: the model's output
    # a checkpointed unit keeps its input (cost/layout.py's ``_input_bytes``); one inside another checkpointed
    # unit (an ep view's experts unit in a checkpointed block: cost/ep.py's ``expert_units``) keeps nothing more
    ckpt = {m for u in units if u.checkpoint and not u.is_root for m in u.modules}
    kept_in = [max((ssim.graph.info(m).output_bytes for m in u.modules), default=0) * scale
               if not u.is_root and not any(a in ckpt for m in u.modules for a in ancestors(m)[1:]) else 0
               for u in units]
    held = held_bytes(est, units, kept_in, ssim.graph.loss_saved_bytes * scale if last else 0.0)
    return stage_cost(est, units, loss_s=ssim.compute.loss_s * scale if last else 0.0, send_bytes=0.0 if last else out,
                      held=held, action_s=ssim.compute.pipeline_action_s, output_bytes=out)


def simulate_pipeline(sim: Any, plan: PlanSpec, *, record: bool = False) -> CostEstimate:
    """``Simulator.simulate`` of a pipeline plan: See [Note: pipeline stages]. ``sim`` is the
    model's simulator (``Simulator.for_stage`` and ``for_tp`` give the stages')."""
    views = stage_simulators(sim, plan)
    stages = [price_stage(ssim, units, plan, last=s == len(views) - 1) for s, (ssim, units) in enumerate(views)]
    est, sync = compose_pipeline(sim.fabric, plan, stages, record=record), tied_sync_s(sim.graph, plan, sim.fabric)
    return replace(est, step_s=est.step_s + sync, comm_s=est.comm_s + sync,  # See [Note: tied copies on stages]
                   exposed_comm_s=est.exposed_comm_s + sync) if sync else est


def compose_pipeline(fabric: FabricProfile, plan: PlanSpec, stages: list[StageCost], *,
                     record: bool = False) -> CostEstimate:
    """The pipeline plan's estimate from its stages' costs (``price_stage``): the schedule's
    timeline and the worst rank's memory. See [Note: pipeline stages]."""
    pipe, mesh = plan.pipeline, plan.mesh
    assert pipe is not None
    notes = {n for st in stages for n in st.estimate.notes}
    send = tuple(send_s(fabric, st.send_bytes, cross_nodes=mesh.stages_cross_nodes) for st in stages)
    order = schedule_order(pipe.schedule, mesh.pp_size, len(stages), pipe.microbatches)
    tl = run_timeline(order, stages, send, record=record)
    return _estimate(plan, stages, tl, send, notes)


def rank_peaks(plan: PlanSpec, stages: list[StageCost]) -> tuple[float, ...]:
    """Per pipeline rank its peak bytes with the stages' costs (``price_stage``), as
    ``simulate_pipeline`` counts them (the estimate's ``peak_bytes`` is their largest)."""
    pipe = plan.pipeline
    assert pipe is not None
    tl = run_timeline(schedule_order(pipe.schedule, plan.mesh.pp_size, len(stages), pipe.microbatches), stages,
                      (0.0,) * len(stages))
    return tuple(_rank_memory(stages, tl, r)[0] for r in range(len(tl.end_s)))


def _rank_memory(stages: list[StageCost], tl: Timeline, r: int) -> tuple[float, dict[str, float]]:
    """Pipeline rank ``r``'s peak bytes and what they are made of."""
    p = len(tl.end_s)
    sts = [stages[s] for s in range(len(stages)) if s % p == r]
    acts = sum(n * stages[s].activation_bytes for s, n in enumerate(tl.inflight[r]) if n)
    transient = max(st.transient_bytes for st in sts)
    parts = {k: 0.0 for k in PEAK_PARTS}
    for st in sts:
        for k, v in st.estimate.peak_breakdown:
            if k in ("sharded_params", "optimizer_state", "accumulated_grads"):
                parts[k] += v
        parts["unsharded_params"] += st.kept_bytes
    parts["activations"], parts["working_set"] = acts, transient
    h_acts, h_params, h_transient = tl.held[r] if tl.held else (0.0, 0.0, 0.0)
    if h_acts + h_params + h_transient > acts + transient:  # the worst moment holds a backward's units
        parts["activations"], parts["working_set"] = h_acts, h_transient
        parts["unsharded_params"] += h_params
    return sum(parts.values()), parts


def _estimate(plan: PlanSpec, stages: list[StageCost], tl: Timeline, send: tuple[float, ...],
              notes: set[str]) -> CostEstimate:
    """The ``CostEstimate`` of a pipeline plan: the worst rank's memory, the makespan's step."""
    p, m = len(tl.end_s), plan.pipeline.microbatches  # type: ignore[union-attr]
    mine = [[s for s in range(len(stages)) if s % p == r] for r in range(p)]
    peaks, parts_of = zip(*(_rank_memory(stages, tl, r) for r in range(p)))
    worst = max(range(p), key=peaks.__getitem__)
    optim = max(sum(stages[s].optim_s for s in mine[r]) for r in range(p))
    step = tl.makespan_s + optim
    busiest = max(range(p), key=lambda r: tl.busy_s[r])
    compute = sum(stages[s].compute_s for s in mine[busiest]) * m
    kept_f, kept_b = tl.saved_s[busiest] if tl.saved_s else (0.0, 0.0)  # all-gathers skipped: units kept gathered
    # what the skipped all-gathers saved includes their unit overhead (host work, not a collective),
    # so it can exceed the collectives left: no negative communication
    comm = max(0.0, sum(stages[s].mb_comm_s * m + stages[s].once_comm_s for s in mine[busiest]) - kept_f - kept_b)
    fwd = sum(stages[s].fwd_s * m + stages[s].first_extra_s for s in mine[busiest]) - kept_f
    bwd = sum(stages[s].bwd_s * m + stages[s].reduce_s for s in mine[busiest]) - kept_b
    events = tuple(TimelineEvent("compute", {"F": "fwd", "B": "bwd", "R": "reduce_scatter"}[k],
                                 f"rank{r} stage{s}" + (f" mb{mb}" if mb >= 0 else ""), a, b)
                   for r, k, s, mb, a, b in tl.events)
    return CostEstimate(step_s=step, fwd_s=fwd, bwd_s=bwd, compute_s=compute, comm_s=comm + sum(send) * m,
                        exposed_comm_s=max(0.0, step - compute - optim), peak_bytes=int(peaks[worst]),
                        peak_breakdown=tuple((k, int(v)) for k, v in parts_of[worst].items()),
                        units=_unit_costs(plan, stages), timeline=events, notes=tuple(sorted(notes)), optim_s=optim,
                        accumulation_sync=None)


def _unit_costs(plan: PlanSpec, stages: list[StageCost]) -> tuple[UnitCost, ...]:
    """Per unit of the plan (in its order) its stage's figures; the root's summed over the stages."""
    by_name: dict[str, UnitCost] = {}
    root = [0.0] * 6
    for st in stages:
        costs = list(st.estimate.units)
        for c in costs[:-1]:
            by_name[c.name] = c
        root = [a + b for a, b in zip(root, costs[-1][1:])]
    rc = UnitCost(plan.root.name, int(root[0]), *root[1:5], int(root[5]))
    return tuple(by_name[u.name] if not u.is_root else rc for u in plan.units)
