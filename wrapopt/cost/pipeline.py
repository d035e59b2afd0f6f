"""A pipeline plan's step: each stage's FSDP step, per micro-batch, run in the order torch's
pipeline schedule runs them.

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
last stage's: the logits), and the transient is the rest of the plain step's peak, without it.
Measured, gpt-tiny in 2 stages x 2 gloo ranks (its head's tied copy: [Note: tied copies on stages]
in ``cost/stage_view.py``), peak per pipeline rank, predicted / measured MiB: 1F1B of 4 micro-batches
6.92 / 6.93 and 6.78 / 6.75 (4.03 without the output and the copy), Interleaved1F1B of 4 on 4 stages
5.85 / 6.13 and 8.52 / 8.61 (5.71), GPipe of 2 10.17 / 9.01 and 16.44 / 15.56.

[Note: pipeline actions] torch's schedule does host work for every forward and backward action (the
stage's bookkeeping, receive buffers and point-to-point calls, autograd's call into it): on 2 gloo
ranks, a 2-stage pipeline with nothing to compute steps about 1.1-1.4 ms slower per micro-batch. A
measured profile carries it per action (``pipeline_action_s``, ``measure_pipeline_action``: a 1F1B of
2 and of 8 micro-batches on rank pairs, less the two sends each micro-batch adds, which ``send_s``
charges), and every forward and backward of a stage pays it. Analytical profiles leave it 0 (host
work a GPU's run-ahead may hide; not measured here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Protocol

from torch.distributed.pipelining import schedules as torch_schedules

from wrapopt.cost.stage_view import stage_of, tied_sync_s
from wrapopt.hardware.profiles import FabricProfile
from wrapopt.spec import CostEstimate, PlanSpec, SimOptions, TimelineEvent, UnitCost, UnitSpec

__all__ = ["StageCost", "Timeline", "schedule_order", "run_timeline", "send_s", "stage_cost", "held_bytes",
           "held_moment", "stage_units", "simulate_pipeline", "stage_options", "stage_simulators", "price_stage",
           "compose_pipeline", "rank_peaks"]

_PEAK_PARTS = ("sharded_params", "sharded_grads", "optimizer_state", "accumulated_grads", "unsharded_params",
               "all_gather_buffer", "unsharded_grads", "activations", "working_set")

Action = tuple[str, int, int]  # ("F" | "B" | "R", stage, micro-batch; -1 for R)


class _StageSimulator(Protocol):  # what this module asks of ``cost.simulate.Simulator``
    options: SimOptions
    fabric: FabricProfile

    def simulate(self, plan: PlanSpec, *, record: bool = False) -> CostEstimate: ...


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage's figures per micro-batch: See [Note: pipeline stages]."""

    fwd_s: float
    bwd_s: float
    first_extra_s: float  # the first micro-batch's forward: the kept units' all-gathers
    reduce_s: float  # REDUCE_GRAD after the last backward
    optim_s: float
    static_bytes: float
    kept_bytes: float
    activation_bytes: float  # per micro-batch in flight
    transient_bytes: float
    compute_s: float  # forward and backward compute of one micro-batch
    mb_comm_s: float  # collectives every micro-batch runs (the resharded units' all-gathers)
    once_comm_s: float  # collectives once a step (the kept units' all-gathers, the reduction)
    send_bytes: float  # activation handed to the next stage per micro-batch (0 on the last)
    estimate: CostEstimate  # the stage simulator's, one micro-batch (accumulation 2, sync "last")
    fwd_gathered_s: float | None = None  # forward right after the stage's backward: no all-gathers (None: fwd_s)
    bwd_gathered_s: float | None = None  # backward right after the stage's backward: no re-gathers (None: bwd_s)
    gathered_bytes: float = 0.0  # the resharded units' parameters, gathered: what a backward leaves gathered
    transient_gathered_bytes: float = 0.0  # of transient_bytes, parameters gathered (within gathered_bytes)


@dataclass(frozen=True, slots=True)
class Timeline:
    """``run_timeline``'s answer."""

    end_s: tuple[float, ...]  # per rank, its last action's end
    busy_s: tuple[float, ...]  # per rank, time in its actions
    inflight: tuple[tuple[int, ...], ...]  # per rank, per stage: micro-batches in flight at the rank's worst moment
    events: tuple[tuple[int, str, int, int, float, float], ...] = ()  # rank, kind, stage, micro-batch, start, end
    saved_s: tuple[tuple[float, float], ...] = ()  # per rank, (forward, backward) all-gather time units kept gathered
    held: tuple[tuple[float, float, float], ...] = ()  # per rank, its worst moment with units held: ``held_moment``

    @property
    def makespan_s(self) -> float:
        return max(self.end_s)


@functools.lru_cache(maxsize=256)
def schedule_order(schedule: str, pp_size: int, num_stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, its actions in the order torch runs them: See [Note: pipeline stages]."""
    m, p = microbatches, pp_size
    if schedule == "GPipe":
        raw = torch_schedules.ScheduleGPipe._get_pipeline_order(SimpleNamespace(_num_stages=p, _n_microbatches=m))
        orders = [raw[r] for r in range(p)]
    elif schedule == "1F1B":
        orders = [_one_f_one_b(r, p, m) for r in range(p)]
    elif schedule == "Interleaved1F1B":
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"Interleaved1F1B needs the micro-batches ({m}) to be a multiple of the rounds "
                             f"({rounds} = max(1, {m} // {p})), as torch's ScheduleInterleaved1F1B requires")
        stub = SimpleNamespace(n_local_stages=num_stages // p, pp_group_size=p, _n_microbatches=m,
                               number_of_rounds=rounds, microbatches_per_round=m // rounds)
        cls = torch_schedules.ScheduleInterleaved1F1B
        orders = [torch_schedules._add_reduce_grad(cls._calculate_single_rank_operations(stub, r), m)
                  for r in range(p)]
    else:
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    return tuple(tuple(_action(a) for a in rank if a is not None) for rank in orders)


def _one_f_one_b(rank: int, p: int, m: int) -> list[Any]:
    """``Schedule1F1B._step_microbatches``'s order on ``rank``, as torch ``_Action`` items."""
    act, types = torch_schedules._Action, torch_schedules._ComputationType
    warm = min(m, p - rank)
    out = [act(rank, types.FORWARD, i) for i in range(warm)]
    fwd = warm
    for b in range(m):
        out.append(act(rank, types.FULL_BACKWARD, b))
        if fwd < m:
            out.append(act(rank, types.FORWARD, fwd))
            fwd += 1
    return torch_schedules._add_reduce_grad(out, m)


def _action(a: Any) -> Action:
    kind = a.computation_type.value
    code = {"F": "F", "B": "B", "REDUCE_GRAD": "R"}.get(kind)
    if code is None:
        raise ValueError(f"pipeline action {a} is not priced (only F, B and REDUCE_GRAD)")
    return code, a.stage_index, -1 if a.microbatch_index is None else a.microbatch_index


def run_timeline(order: tuple[tuple[Action, ...], ...], stages: list[StageCost] | tuple[StageCost, ...],
                 send: tuple[float, ...], *, record: bool = False) -> Timeline:
    """Execute the per-rank ``order`` with the stages' times and ``send[s]`` (stage s to s+1):
    See [Note: pipeline stages]. Raises RuntimeError if the order cannot run (a dependency cycle)."""
    last = len(stages) - 1
    fend: dict[tuple[int, int], float] = {}
    bend: dict[tuple[int, int], float] = {}
    p = len(order)
    free, busy, pos = [0.0] * p, [0.0] * p, [0] * p
    after_b = [False] * len(stages)  # the stage's last action was a backward: its units are still gathered
    saved = [[0.0, 0.0] for _ in range(p)]
    events: list[tuple[int, str, int, int, float, float]] = []
    left = sum(map(len, order))
    while left:
        moved = False
        for r in range(p):
            ops, i = order[r], pos[r]
            while i < len(ops):
                kind, s, mb = ops[i]
                st = stages[s]
                if kind == "F":
                    dep = 0.0 if s == 0 else fend.get((s - 1, mb))
                    if dep is None:
                        break
                    ready = dep + (send[s - 1] if s else 0.0)
                    fwd = st.fwd_gathered_s if after_b[s] and st.fwd_gathered_s is not None else st.fwd_s
                    saved[r][0] += st.fwd_s - fwd
                    dur = fwd + (st.first_extra_s if mb == 0 else 0.0)
                    after_b[s] = False
                elif kind == "B":
                    dep = fend.get((s, mb)) if s == last else bend.get((s + 1, mb))
                    if dep is None:
                        break
                    ready = dep + (send[s] if s < last else 0.0)
                    dur = st.bwd_gathered_s if after_b[s] and st.bwd_gathered_s is not None else st.bwd_s
                    saved[r][1] += st.bwd_s - dur
                    after_b[s] = True
                else:
                    ready, dur = 0.0, st.reduce_s
                start = max(free[r], ready)
                end = start + dur
                (fend if kind == "F" else bend)[(s, mb)] = end
                free[r], busy[r] = end, busy[r] + dur
                if record:
                    events.append((r, kind, s, mb, start, end))
                i += 1
                left -= 1
                moved = True
            pos[r] = i
        if not moved:
            raise RuntimeError(f"the pipeline order cannot run: ranks stopped at {pos}")
    return Timeline(tuple(free), tuple(busy), tuple(_inflight(ops, stages) for ops in order), tuple(events),
                    tuple((f, b) for f, b in saved), tuple(held_moment(ops, stages) for ops in order))


def _inflight(ops: tuple[Action, ...], stages: Any) -> tuple[int, ...]:
    """Per stage, the micro-batches in flight on a rank at its worst moment (the most activation
    bytes): a micro-batch holds its activations from its forward to its backward."""
    held = [0] * len(stages)
    worst, worst_bytes = tuple(held), -1.0
    for kind, s, _mb in ops:
        if kind == "F":
            held[s] += 1
            total = sum(n * stages[i].activation_bytes for i, n in enumerate(held) if n)
            if total > worst_bytes:
                worst, worst_bytes = tuple(held), total
        elif kind == "B":
            held[s] -= 1
    return worst


def held_moment(ops: tuple[Action, ...], stages: Any) -> tuple[float, float, float]:
    """(activations in flight, parameters held gathered, transient) at a rank's worst moment while
    units a backward left gathered are held: at the start of each forward and backward of its
    ``ops``; zeros when nothing is ever held. See [Note: pipeline stages], the memory of units held."""
    n = len(stages)
    inflight, held = [0] * n, [False] * n
    worst, worst_total = (0.0, 0.0, 0.0), 0.0
    for kind, s, _mb in ops:
        if kind == "R":  # REDUCE_GRAD's post_backward reshards them
            held[s] = False
            continue
        params = sum(stages[i].gathered_bytes for i in range(n) if held[i])
        if params > 0:
            acts = sum(k * stages[i].activation_bytes for i, k in enumerate(inflight) if k)
            # the acting stage's transient gathers nothing it already holds
            transient = stages[s].transient_bytes - (stages[s].transient_gathered_bytes if held[s] else 0.0)
            if acts + params + transient > worst_total:
                worst, worst_total = (acts, params, transient), acts + params + transient
        if kind == "F":  # the forward reshards the units after their forward; its activations stay
            inflight[s], held[s] = inflight[s] + 1, False
        else:  # the backward frees its activations and leaves its units gathered
            inflight[s], held[s] = inflight[s] - 1, True
    return worst


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
    base = sim.for_tp(plan.tp, mesh.tp_size)[0] if plan.tp is not None else sim
    options = stage_options(base.options, mesh.pp_size, pipe.microbatches)  # the tp view scales its batch
    n = len(pipe.stages)
    return [(base.for_stage(tuple(mods), first=s == 0, last=s == n - 1, options=options), units)
            for s, (mods, units) in enumerate(zip(pipe.stages, stage_units(plan)))]


def price_stage(ssim: Any, units: tuple[UnitSpec, ...], plan: PlanSpec, *, last: bool) -> StageCost:
    """One stage's ``StageCost`` with ``units`` (the root's last) on ``ssim`` (``stage_simulators``)."""
    est = ssim.simulate(PlanSpec(units=units, mesh=plan.mesh.data_parallel(), forward_prefetch=plan.forward_prefetch))
    scale = ssim.options.batch_scale
    out = ssim.graph.root.output_bytes * scale  # the activation sent on; the last stage's: the model's output
    kept_in = [max((ssim.graph.info(m).output_bytes for m in u.modules), default=0) * scale if not u.is_root else 0
               for u in units]  # a checkpointed unit keeps its input: cost/layout.py's ``_input_bytes``
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
    parts = {k: 0.0 for k in _PEAK_PARTS}
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
    comm = sum(stages[s].mb_comm_s * m + stages[s].once_comm_s for s in mine[busiest]) - kept_f - kept_b
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
