"""What the ``Simulator`` keeps per set of units, mesh and plan, and the ``CostEstimate`` it
makes of a step loop's run.

``simulate.py`` builds these records (``UnitSet`` per set of units, ``MeshCosts`` per
mesh, ``Choices`` and ``Run`` per plan) and calls ``choose_run`` and ``make_estimate``
once the loop has run. The modelling decisions they apply are [Note: accumulation sync]
in ``simulate.py`` and [Note: memory] in ``step.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from wrapopt.cost.layout_types import KEEPS, Layout
from wrapopt.cost.step import KINDS, LANES
from wrapopt.cost.step_inputs import CK_FULL, CK_SELECTIVE, StepResult
from wrapopt.spec import CostEstimate, PlanSpec, SimOptions, TimelineEvent, UnitCosts, UnitSpec

__all__ = ["Choices", "MeshCosts", "PEAK_PARTS", "Run", "UnitSet", "choose_run", "make_estimate"]

# CostEstimate.peak_breakdown's names: the four the simulator adds, then StepResult.peak_parts'.
PEAK_PARTS = ("sharded_params", "sharded_grads", "optimizer_state", "accumulated_grads", "unsharded_params",
              "all_gather_buffer", "unsharded_grads", "activations", "working_set")


class MeshCosts(NamedTuple):
    """Per set of units and mesh: the units' bytes and collective times, static memory, the optimizer step."""

    gathered_bytes: np.ndarray
    grad_bytes: np.ndarray
    all_gather_s: np.ndarray
    units: UnitCosts  # what ``CostEstimate.units`` reports
    notes: frozenset[str]
    # the first five columns of ``UnitPlan`` (gathered and gradient bytes, all-gather, reduce-scatter,
    # all-reduce times), as rows of one float64 array
    columns: tuple[np.ndarray, ...]
    sharded_params_bytes: float  # See [Note: memory] in step.py
    optimizer_bytes: float  # optimizer state, sharded
    optim_s: float  # the optimizer step: See ``state.optimizer_s`` or ``state.cpu_optimizer_s``


class Run(NamedTuple):
    """One scoring of a plan in one accumulation mode: See [Note: accumulation sync] in simulate.py."""

    mode: str | None  # 'every', 'last', or None (no accumulation)
    static_bytes: float  # the step loop's static memory
    held_bytes: float  # unsharded gradients held across micro-batches
    sharded_grads_bytes: float  # sharded gradients in place before backward
    events: np.ndarray  # the step loop's recorded events
    result: StepResult


class Choices(NamedTuple):
    """One plan's per-unit choices as the step loop reads them: See [Note: reshard after forward] in simulate.py."""

    regather_s: np.ndarray  # backward all-gather (0: kept since forward)
    kept_bytes: np.ndarray  # parameters kept from forward to backward
    checkpoint: np.ndarray  # int: 0 none, 1 full, 2 selective-op (CK_CODES)
    any_checkpoint: bool


class UnitSet(NamedTuple):
    """Per set of units: what every plan of these units shares. See [Note: simulator speed] in backend.py."""

    layout: Layout
    storage_bytes: int
    trainable_bytes: int
    compute_s: float  # forward and backward, once
    per_mesh: dict[Any, MeshCosts]
    param_overhead_s: np.ndarray  # per unit: See [Note: per-parameter overhead] in hardware/measure_fsdp.py


def choose_run(runs: list[Run], options: SimOptions) -> Run:
    """Of the runs in modes 'last' and 'every', the faster that fits the memory budget,
    else the smaller peak: See [Note: accumulation sync] in simulate.py."""
    micro = options.grad_accumulation
    limit = options.memory_budget_bytes if options.memory_budget_bytes is not None else float("inf")
    fit = [r for r in runs if r.result.peak_bytes <= limit]
    last, every = runs
    times = {"last": last.result.bwd_end * (micro - 1) + last.result.end, "every": every.result.end * micro}
    return min(fit, key=lambda r: times[r.mode]) if fit else min(runs, key=lambda r: r.result.peak_bytes)


def _timeline(run: Run, units: tuple[UnitSpec, ...]) -> list[TimelineEvent]:
    """The step loop's recorded rows as events (codes: ``step.LANES``, ``step.KINDS``)."""
    return [TimelineEvent(LANES[int(r[0])], KINDS[int(r[1])], units[int(r[2])].name, float(r[3]), float(r[4]),
                          int(r[5])) for r in run.events[:run.result.num_events]]


def _compute_s(per_set: UnitSet, choices: Choices, *, checkpoint_overhead_s: float, loss_s: float,
               options: SimOptions) -> float:
    """Compute of all micro-batches: forward and backward, recomputed forwards and their
    overhead, and the loss (``loss_s``: the profile's, before the batch scale)."""
    lay, codes, any_ck = per_set.layout, choices.checkpoint, choices.any_checkpoint
    compute_s = per_set.compute_s
    if any_ck:  # full: the forward again, up to its early stop (Segment.ckpt_fwd_s); selective-op: its other
        # ops (Segment.sel_fwd_s), and its dispatch modes' work in forward and in the recompute (sel_ops_s, twice)
        full, sel = codes == CK_FULL, codes == CK_SELECTIVE
        compute_s += (sum(lay.times[4][full].tolist()) + sum(lay.times[2][sel].tolist())  # sum([]) is 0
                      + 2.0 * sum(lay.times[3][sel].tolist()))
        if checkpoint_overhead_s:
            compute_s += checkpoint_overhead_s * int(lay.counts[KEEPS][codes > 0].sum())
    compute_s += loss_s * options.batch_scale
    return compute_s * options.grad_accumulation


def make_estimate(plan: PlanSpec, per_set: UnitSet, per_mesh: MeshCosts, choices: Choices, run: Run,  # noqa: PLR0913
                  notes: set[str], *, record: bool, checkpoint_overhead_s: float, loss_s: float,
                  options: SimOptions) -> CostEstimate:
    """The ``CostEstimate`` of ``run``: the step's time with the optimizer and the earlier
    micro-batches (See [Note: accumulation sync] in simulate.py), and the peak's breakdown."""
    res, micro, mode = run.result, options.grad_accumulation, run.mode
    ev = _timeline(run, plan.units) if record else []
    optim_s = per_mesh.optim_s
    step = res.end + optim_s
    if record:
        ev.append(TimelineEvent("compute", "optim", "<all>", res.end, step, int(run.static_bytes)))
    comm_total = res.comm_s
    if micro > 1:
        if mode == "every":  # every micro-batch: forward, backward and its reduce-scatters
            step += (micro - 1) * res.end
            comm_total *= micro
        else:
            # Earlier micro-batches: the same forward and backward without the
            # reduce-scatters (set_requires_gradient_sync(False)).
            step += (micro - 1) * res.bwd_end
    compute_s = _compute_s(per_set, choices, checkpoint_overhead_s=checkpoint_overhead_s, loss_s=loss_s,
                           options=options)
    sharded_params, optim = per_mesh.sharded_params_bytes, per_mesh.optimizer_bytes
    grads_before, peak_parts = run.sharded_grads_bytes, res.peak_parts
    parts = (sharded_params, peak_parts[0] + grads_before if grads_before else peak_parts[0], optim, run.held_bytes)
    return CostEstimate(
        step_s=step,
        fwd_s=res.fwd_end,
        bwd_s=res.bwd_end - res.fwd_end,
        compute_s=compute_s,
        comm_s=comm_total,
        exposed_comm_s=max(0.0, step - compute_s - optim_s),
        peak_bytes=int(res.peak_bytes),
        peak_breakdown=tuple(zip(PEAK_PARTS, map(int, parts + peak_parts[1:]))),
        units=per_mesh.units,
        timeline=tuple(ev),
        notes=tuple(sorted(notes)),
        optim_s=optim_s,
        accumulation_sync=mode,
    )
