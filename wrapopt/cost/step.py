"""The step loop: forward and backward over the segments, on two lanes, and the notes
on how FSDP2 runs a step that it applies.

Two lanes: *compute* (the default stream / the Python thread on CPU) and
*comm* (collectives). ``step_loop`` walks the forward in execution order
(``_forward``), the loss (``_loss``) and the backward in reverse
(``_backward``), placing each unit's all-gather, compute and reduce-scatter
where FSDP2 places them, and tracks memory at every event (``_hold``) in one
state array: the memory parts, the peak, the lanes' clocks. The
notes below are its modelling decisions; code cites them as
``# See [Note: ...]``. It records events as rows of ``ev``: lane, kind, unit,
start, end, memory, with the codes below. Its inputs are the named tuples of
``step_inputs.py`` (``simulate.py`` builds them); ``backend.py`` compiles it
(numba) or runs it as Python: See [Note: compiled step loop] in
``backend.py``.

[Note: all-gather issue] A unit's all-gather is issued at its pre-forward.
On a GPU the CPU runs ahead, so the next unit's all-gather is already issued
while this unit computes (FSDP2 lets at most one all-gather run ahead:
depth 1). On CPU (gloo) there is no running ahead: without explicit prefetch
the all-gather is issued when compute reaches the unit, and is exposed (with
it too: See [Note: blocking collectives]).
``PlanSpec.forward_prefetch = k`` issues it k units early
(``set_modules_to_forward_prefetch``). All collectives share one lane and
run in issue order.

[Note: backward schedule] Backward walks the segments in reverse. At a
unit's pre-backward FSDP2 issues its all-gather (if resharded) and prefetches
the next unit's in backward order ([Note: pre-backward] the first of these
run beside the output's gradient, on which FSDP2's hook fires, so that
gradient is held while they gather). A checkpointed unit first recomputes
its forward, each checkpointed block paying the profile's measured
``checkpoint_overhead_s`` on top, less the part its forward paid (See
[Note: checkpoint overhead]). After the unit's last backward segment its
gradients are reduce-scattered (then all-reduced across the replicate axis
under HSDP); the unsharded gradients live until the next unit's
post-backward (See [Note: reduce-scatter buffer]). The step ends when the
last collective lands, plus the optimizer step (memory-bound on the local shard).

[Note: memory] At any instant: sharded parameters + sharded gradients +
optimizer state (all / shard size) + gathered units + unsharded gradients
awaiting reduce-scatter + saved activations not yet consumed + the working
set of the segment computing now (its largest module output, twice: the
output and the incoming gradient in backward). A checkpointed unit keeps only
its input during forward and re-saves its activations while it recomputes. A
selective-op unit (``UnitPlan.checkpoint == CK_SELECTIVE``) keeps its input and the
outputs of its matmuls and attention (``Segments.sel_keep``) and recomputes only its
other ops (``sel_fwd_s``); its forward and its recompute each pay the dispatch modes' per-op
work (``sel_ops_s``): See [Note: selective checkpointing] in wrapopt/selective.py.

[Note: reduce-scatter buffer] At a unit's post-backward FSDP2 copies its
unsharded gradients into one reduce-scatter input buffer (both exist for a
moment), frees the gradients, and keeps the buffer referenced until the next
unit's post-backward, which first waits for that reduce-scatter
(``reduce_scatter_max_input_buffers = 1``); the last is freed when backward
ends. So a unit's gradients are held until the next unit in backward order
finishes, however fast the collective is; the sharded gradients are
allocated when the reduce-scatter is issued.

[Note: loss] The loss runs after forward, outside every module. While it
runs, memory holds the model's output and the tensors the loss creates (the
tracer's ``loss_peak_bytes``: for cross-entropy a flattened copy and
log_softmax's output); afterwards what it saved (``loss_saved_bytes``) stays
until its backward, which holds its gradients beside it: the tracer's
``loss_grad_bytes`` (cross-entropy: the gradient arriving at log_softmax and the
one leaving it, in the dtype the loss computes in: float32 where it upcasts
bf16 logits, twice the bytes of the output), at least two of the output's size.
See [Note: the loss's gradients] in trace/record.py.

[Note: all-gather buffer] FSDP2 (torch 2.13, ``wait_for_unshard``) keeps a
forward all-gather's output after its copy-out, to overlap the copy-out with
the next collective, and frees it just before the next unit's copy-out; the
root's post-forward frees the last one. So while forward computes, the unit
before holds its gathered size once more (the whole model for a root-only
plan), on every device. Backward all-gathers free theirs at once; a shard
group of one gathers nothing.

[Note: collective copies] gloo's all-gather and reduce-scatter allocate a
buffer of the collective's unsharded size while they run, free again by the
time the collective is waited on; ``FabricProfile.collective_copies`` states
it per backend (NCCL and
analytical fabrics: 0). So an all-gather holds its output and that copy while
it runs; by its copy-out the copy is gone. A reduce-scatter's copy adds
nothing to its copy-in: FSDP2 frees the unsharded gradients once copied into
the input buffer (``foreach_reduce``), before it runs.

[Note: shard group of one] A shard group of one gathers and reduce-scatters
nothing: no collective copy, no all-gather output kept. It pays the per-unit
overhead all the same: FSDP2's unshard still runs its copy-in, its "all-gather"
of one rank and its copy-out into every parameter.

[Note: overlap] Collectives are not free when overlapped: a compute segment
that starts while the comm lane is busy runs ``1 + overlap_compute_slowdown``
times longer over the overlapped part, and a collective issued while compute
is busy runs ``1 + overlap_comm_slowdown`` times longer. Both factors are
measured by the profiler.

[Note: checkpoint overhead] Checkpointing a block costs more than its
recomputed forward: ``ComputeProfile.checkpoint_overhead_s`` per checkpointed
block, measured on the model's first block (``measure_checkpoint_overhead``).
Part of it runs in the first forward (the checkpoint's forward hooks and
saved-tensor hooks), ``checkpoint_forward_s``, and the rest in the recompute,
so each phase is charged its own part. The part is measured on the block
alone; inside an FSDP step the checkpointed forward runs slower still, which
is not priced (the step's total is).

[Note: blocking collectives] On a CPU (``ComputeProfile.runs_ahead`` False) a
rank computes nothing while its collectives run: FSDP2 (torch 2.13) issues
its all-gathers with ``unshard_async_op = False``, prefetches included, and
its reduce-scatter and all-reduce without ``async_op``, and a gloo collective
called so returns only when it has ended. So there (``StepConstants.serial``)
compute waits for every collective it issued: a prefetched all-gather, and a
unit's reduction before the unit's post-reduction work; nothing overlaps and
[Note: overlap]'s factors never apply. A GPU's streams run collectives beside
the kernels; there the lanes overlap as above. So on a CPU an explicit
forward prefetch hides nothing: it only moves the wait earlier.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from wrapopt.cost.step_inputs import CK_FULL, CK_SELECTIVE, PlanScalars, Segments, StepConstants, UnitLayout, UnitPlan

__all__ = ["EVENT_HELPERS", "KINDS", "LANES", "PHASES", "STATE_SIZE", "new_state", "step_loop"]

COMPUTE, COMM = 0, 1
LANES = ("compute", "comm")
FWD, LOSS, RECOMPUTE, BWD, ALL_GATHER, REDUCE_SCATTER = range(6)
KINDS = ("fwd", "loss", "recompute", "bwd", "all_gather", "reduce_scatter")

# The loop's state, one array ``st``. First the parts of memory that persist between events (See
# [Note: memory]; what an event holds beyond them is its ``extra``), then the peak and the parts at
# it (``StepResult.peak_parts``), the two lanes' clocks, all collectives' time so far, events recorded.
STATIC, SHARDED_GRADS, GATHERED, AG_BUFFER, ACTIVATIONS, GRADS_PENDING = range(6)
PEAK, PEAK_PARTS = 6, 7  # PEAK_PARTS: 6 places
COMPUTE_AT, COMM_AT, COMM_BUSY, NUM_EVENTS = 13, 14, 15, 16
STATE_SIZE = 17


def new_state() -> Any:
    """The loop's state ``st``, all zeros: a list as Python (its numbers stay Python floats), an
    array compiled (``backend.compile_kernels`` gives numba this one: See [Note: compiled step loop])."""
    return [0.0] * STATE_SIZE


def _hold(st: Any, extra: float, more: float = 0.0) -> float:
    """Memory now: the parts, then ``extra`` and ``more`` bytes beyond them (added in this
    order); recorded if a peak."""
    total = (st[STATIC] + st[SHARDED_GRADS] + st[GATHERED] + st[AG_BUFFER] + st[ACTIVATIONS]
             + st[GRADS_PENDING] + extra + more)
    if total > st[PEAK]:
        st[PEAK] = total
        st[PEAK_PARTS + 0] = st[SHARDED_GRADS]
        st[PEAK_PARTS + 1] = st[GATHERED]
        st[PEAK_PARTS + 2] = st[AG_BUFFER]
        st[PEAK_PARTS + 3] = st[GRADS_PENDING]
        st[PEAK_PARTS + 4] = st[ACTIVATIONS]
        st[PEAK_PARTS + 5] = extra + more
    return total


class _Trace(NamedTuple):
    """Where the loop records its events: See [Note: step loop inputs]."""

    on: bool  # PlanScalars.record
    rows: Any  # ev: lane, kind, unit, start, end, memory; st[NUM_EVENTS] of them written


def _record(st: Any, trace: _Trace, lane: int, kind: int, unit: int, start: float, end: float,  # noqa: PLR0913
            held: float) -> None:
    """One event row (callers check ``trace.on``)."""
    rows, i = trace.rows, int(st[NUM_EVENTS])
    rows[i, 0] = lane
    rows[i, 1] = kind
    rows[i, 2] = unit
    rows[i, 3] = start
    rows[i, 4] = end
    rows[i, 5] = held
    st[NUM_EVENTS] = i + 1


def _all_gather(unit: int, at: float, duration_s: float, nbytes: float, extra: float, copy: float,  # noqa: PLR0913
                overlap_comm: float, st: Any, trace: _Trace) -> float:
    """Issue ``unit``'s all-gather of ``nbytes`` at ``at`` on the comm lane, behind what is
    queued there, slowed while compute runs (See [Note: overlap]); meanwhile compute holds
    ``extra`` bytes and the collective its ``copy`` share of ``nbytes`` (See [Note:
    collective copies]). Returns when it lands."""
    start = at if at > st[COMM_AT] else st[COMM_AT]
    duration = duration_s * (overlap_comm if st[COMPUTE_AT] > start else 1.0)
    st[GATHERED] += nbytes
    total = _hold(st, extra + copy * nbytes)
    if trace.on and duration > 0:
        _record(st, trace, COMM, ALL_GATHER, unit, start, start + duration, total)
    st[COMM_AT] = start + duration
    st[COMM_BUSY] += duration
    return start + duration


def _compute(duration_s: float, extra: float, kind: int, unit: int, overlap_compute_extra: float,  # noqa: PLR0913
             st: Any, trace: _Trace) -> None:
    """Compute of ``duration_s`` on the compute lane, slowed where the comm lane is busy
    (See [Note: overlap]), holding ``extra`` bytes beyond the parts."""
    start, comm = st[COMPUTE_AT], st[COMM_AT]
    end = start + duration_s
    if comm > start:
        end += ((comm if comm < end else end) - start) * overlap_compute_extra
    total = _hold(st, extra)
    if trace.on and end > start:
        _record(st, trace, COMPUTE, kind, unit, start, end, total)
    st[COMPUTE_AT] = end


def _reduce(unit: int, duration_s: float, overlap_comm: float, st: Any, trace: _Trace) -> float:
    """``unit``'s reduce-scatter and replicate all-reduce on the comm lane (See [Note:
    overlap]). Returns when they land."""
    start = st[COMPUTE_AT] if st[COMPUTE_AT] > st[COMM_AT] else st[COMM_AT]
    duration = duration_s * (overlap_comm if st[COMPUTE_AT] > start else 1.0)
    st[COMM_AT] = start + duration
    st[COMM_BUSY] += duration
    if trace.on and duration > 0:
        _record(st, trace, COMM, REDUCE_SCATTER, unit, start, start + duration, 0.0)
    return start + duration


def _wait(st: Any) -> None:
    """The compute lane waits for the comm lane: See [Note: blocking collectives]."""
    st[COMPUTE_AT] = max(st[COMPUTE_AT], st[COMM_AT])


# step_loop and its phases unpack their inputs by position (asserted below): See [Note: step loop inputs].
def _forward(segs: Segments, lay: UnitLayout, units: UnitPlan, plan: PlanScalars, k: StepConstants,  # noqa: PLR0913
             st: Any, trace: _Trace) -> None:
    """Forward over the segments: See [Note: segments], [Note: all-gather issue]."""
    seg_unit, fwd_s, _, saved, work, _, _, keep, _, sel_keep, sel_ops_s, _ = segs
    forward, _, last_fwd, fwd_pos, _, _, _, _ = lay
    gathered_bytes, _, all_gather_s, _, _, _, kept_bytes, checkpoint, param_overhead_s = units
    _, _, depth, _, gathers = plan
    _, overlap_compute, overlap_comm, unit_overhead_s, _, _, _, _, _, _, collective_copy, serial, \
        checkpoint_forward_s = k
    overlap_compute_extra = overlap_compute - 1.0
    copy = collective_copy if gathers else 0.0  # See [Note: shard group of one]
    n = len(gathered_bytes)
    ag_end = [0.0] * n  # when each unit's all-gather lands
    issued = [False] * n
    seen = [False] * n
    st[AG_BUFFER] = 0.0  # See [Note: all-gather buffer]: the previous step's last was freed at its forward's end
    u = forward[0]
    ag_end[u] = _all_gather(u, 0.0, all_gather_s[u], gathered_bytes[u], 0.0, copy, overlap_comm, st, trace)
    issued[u] = True
    for si in range(len(seg_unit)):
        u = seg_unit[si]
        if not seen[u]:  # the unit's pre-forward
            seen[u] = True
            if not issued[u]:  # issued when compute reaches the unit
                ag_end[u] = _all_gather(u, st[COMPUTE_AT], all_gather_s[u], gathered_bytes[u], 0.0, copy,
                                        overlap_comm, st, trace)
                issued[u] = True
            # See [Note: shard group of one]
            st[COMPUTE_AT] = max(st[COMPUTE_AT], ag_end[u]) + unit_overhead_s + param_overhead_s[u]
            # copy-out: the output beside the unsharded parameters, the previous one freed first
            # (See [Note: all-gather buffer])
            if gathers:
                st[AG_BUFFER] = 0.0
            _hold(st, gathered_bytes[u] * 1.0)
            if gathers:
                st[AG_BUFFER] = gathered_bytes[u] * 1.0
            ahead = fwd_pos[u] + depth  # prefetch `depth` units ahead, issued at this unit's pre-forward
            if depth and ahead < len(forward) and not issued[forward[ahead]]:
                x = forward[ahead]
                ag_end[x] = _all_gather(x, st[COMPUTE_AT], all_gather_s[x], gathered_bytes[x], 0.0, copy,
                                        overlap_comm, st, trace)
                issued[x] = True
                if serial:
                    _wait(st)
        # selective-op: its dispatch modes' per-op work on top (See [Note: selective checkpointing]); a checkpointed
        # block's start: its forward's part of the checkpoint's overhead (See [Note: checkpoint overhead])
        ck = checkpoint[u]
        _compute(fwd_s[si] + (sel_ops_s[si] if ck == CK_SELECTIVE else 0.0)
                 + (checkpoint_forward_s if ck and keep[si] else 0.0),
                 work[si] * 1.0, FWD, u, overlap_compute_extra, st, trace)
        # Checkpointing wraps each of the unit's blocks: each keeps only its boundary tensor (full),
        # or that and its saved ops' outputs (selective-op).
        st[ACTIVATIONS] += saved[si] if not ck else (keep[si] if ck == CK_FULL else sel_keep[si])
        if si == last_fwd[u]:
            st[GATHERED] -= gathered_bytes[u] - kept_bytes[u]  # reshard after forward
    st[AG_BUFFER] = 0.0  # the root's post-forward frees the last all-gather output: See [Note: all-gather buffer]


def _loss(k: StepConstants, unit: int, st: Any, trace: _Trace) -> None:
    """The loss, forward and backward: See [Note: loss]."""
    _, overlap_compute, _, _, _, loss_s, loss_work_bytes, _, loss_saved_bytes, loss_grad_bytes, _, _, _ = k
    # forward holds the model's output beside what the loss creates
    _compute(loss_s, loss_work_bytes, LOSS, unit, overlap_compute - 1.0, st, trace)
    st[ACTIVATIONS] += loss_saved_bytes
    # its backward: its gradients (the one arriving, the one leaving), beside what it saved
    _hold(st, loss_grad_bytes)
    st[ACTIVATIONS] -= loss_saved_bytes


def _backward(segs: Segments, lay: UnitLayout, units: UnitPlan, plan: PlanScalars, k: StepConstants,  # noqa: PLR0913
              st: Any, trace: _Trace) -> None:
    """Backward over the segments in reverse: See [Note: backward schedule]."""
    seg_unit, _, bwd_s, saved, work, grad_numel, bwd_work, keep, sel_fwd_s, sel_keep, sel_ops_s, ckpt_fwd_s = segs
    _, backward, _, _, bwd_pos, num_segments, seg_grad_numel, trainable_bytes = lay
    gathered_bytes, grad_bytes, _, reduce_scatter_s, all_reduce_s, regather_s, kept_bytes, checkpoint, \
        param_overhead_s = units
    _, shard_size, _, _, gathers = plan
    reduce_elem_bytes, overlap_compute, overlap_comm, unit_overhead_s, checkpoint_overhead_s, _, _, output_bytes, \
        _, _, collective_copy, serial, checkpoint_forward_s = k
    overlap_compute_extra = overlap_compute - 1.0
    copy = collective_copy if gathers else 0.0  # See [Note: shard group of one]
    n = len(gathered_bytes)
    ag_end = [0.0] * n  # when each unit's backward all-gather lands
    issued = [False] * n
    started = [False] * n
    done = [0] * n  # its segments' backward done
    held, held_end, held_bytes = False, 0.0, 0.0  # the reduce-scatter input FSDP2 still holds
    last = len(seg_unit) - 1
    for si in range(last, -1, -1):
        u = seg_unit[si]
        if not started[u]:  # the unit's pre-backward
            started[u] = True
            # See [Note: pre-backward]: the first segment's all-gathers run beside the output's gradient.
            arriving = output_bytes * 1.0 if si == last else 0.0
            if regather_s[u] > 0 and not issued[u]:
                ag_end[u] = _all_gather(u, st[COMPUTE_AT], regather_s[u], gathered_bytes[u] - kept_bytes[u], arriving,
                                        copy, overlap_comm, st, trace)
                issued[u] = True
            st[COMPUTE_AT] = max(st[COMPUTE_AT], ag_end[u]) + (unit_overhead_s + param_overhead_s[u]
                                                               if regather_s[u] > 0 else 0.0)
            if regather_s[u] > 0:  # copy-out transient; freed at once in backward
                _hold(st, arriving, gathered_bytes[u])
            ahead = bwd_pos[u] + 1  # backward prefetch of the next unit (FSDP2 default)
            x = backward[ahead] if ahead < len(backward) else -1
            if x >= 0 and regather_s[x] > 0 and not issued[x]:
                ag_end[x] = _all_gather(x, st[COMPUTE_AT], regather_s[x], gathered_bytes[x] - kept_bytes[x], arriving,
                                        copy, overlap_comm, st, trace)
                issued[x] = True
                if serial:
                    _wait(st)
        ck = checkpoint[u]
        if ck:  # recompute this block's forward (selective-op: its other ops), re-saving its activations
            full = ck == CK_FULL
            st[ACTIVATIONS] += saved[si] - (keep[si] if full else sel_keep[si])
            _compute((ckpt_fwd_s[si] if full else sel_fwd_s[si] + sel_ops_s[si])
                     + (checkpoint_overhead_s - checkpoint_forward_s if keep[si] else 0.0),
                     work[si] * 1.0, RECOMPUTE, u, overlap_compute_extra, st, trace)
        # See [Note: progressive backward] for the working set.
        _compute(bwd_s[si], bwd_work[si] * 1.0, BWD, u, overlap_compute_extra, st, trace)
        st[GRADS_PENDING] += grad_numel[si] * reduce_elem_bytes
        st[ACTIVATIONS] -= saved[si]
        done[u] += 1
        if done[u] == num_segments[u]:  # the unit's post-backward
            st[GRADS_PENDING] += grad_bytes[u] - seg_grad_numel[u] * reduce_elem_bytes
            st[GATHERED] -= kept_bytes[u] if not regather_s[u] > 0 else gathered_bytes[u]
            # See [Note: reduce-scatter buffer]: copy-in, then wait for and free the previous one.
            # See [Note: collective copies]: the gradients are freed before the collective's copy.
            _hold(st, grad_bytes[u] * (copy if copy > 1.0 else 1.0))
            if held:
                st[COMPUTE_AT] = max(st[COMPUTE_AT], held_end)
                st[GRADS_PENDING] -= held_bytes
            # Reduce-scatter, then all-reduce across the replicas (HSDP; shard size 1 is DDP-like).
            held, held_bytes = True, grad_bytes[u] * 1.0
            held_end = _reduce(u, reduce_scatter_s[u] + all_reduce_s[u], overlap_comm, st, trace)
            st[SHARDED_GRADS] += trainable_bytes[u] / shard_size
            if serial:
                _wait(st)
            st[COMPUTE_AT] += unit_overhead_s + param_overhead_s[u]


def step_loop(segs: Segments, lay: UnitLayout, units: UnitPlan, plan: PlanScalars, k: StepConstants,  # noqa: PLR0913
              ev: Any) -> tuple[Any, ...]:
    """One step's forward and backward over ``segs``, recording events into ``ev`` when
    ``plan.record`` (its rows: at least ``3 * units + 3 * segments + 2``). Takes the named
    tuples or plain tuples in their field order, and returns ``StepResult``'s fields as a
    plain tuple: See [Note: step loop inputs]."""
    static_bytes, _, _, record, _ = plan
    st = new_state()
    st[STATIC] = static_bytes
    trace = _Trace(record, ev)
    _forward(segs, lay, units, plan, k, st, trace)
    _loss(k, len(units[0]) - 1, st, trace)
    fwd_end = st[COMPUTE_AT]
    _backward(segs, lay, units, plan, k, st, trace)
    bwd_end, end = st[COMPUTE_AT], max(st[COMPUTE_AT], st[COMM_AT])
    parts = (st[PEAK_PARTS], st[PEAK_PARTS + 1], st[PEAK_PARTS + 2], st[PEAK_PARTS + 3], st[PEAK_PARTS + 4],
             st[PEAK_PARTS + 5])
    return fwd_end, bwd_end, end, st[COMM_BUSY], st[PEAK], parts, int(st[NUM_EVENTS])  # StepResult's fields


# step_loop unpacks its inputs by position: these are the orders it reads.
assert Segments._fields == ("unit", "fwd_s", "bwd_s", "saved", "work", "grad_numel", "bwd_work", "keep", "sel_fwd_s",
                            "sel_keep", "sel_ops_s", "ckpt_fwd_s")
assert UnitLayout._fields == ("forward", "backward", "last_fwd", "fwd_pos", "bwd_pos", "num_segments", "seg_grad_numel",
                              "trainable_bytes")
assert UnitPlan._fields == ("gathered_bytes", "grad_bytes", "all_gather_s", "reduce_scatter_s", "all_reduce_s",
                            "regather_s", "kept_bytes", "checkpoint", "param_overhead_s")
assert PlanScalars._fields == ("static_bytes", "shard_size", "prefetch_depth", "record", "gathers")
assert StepConstants._fields == ("reduce_elem_bytes", "overlap_compute", "overlap_comm", "unit_overhead_s",
                                 "checkpoint_overhead_s", "loss_s", "loss_work_bytes", "output_bytes",
                                 "loss_saved_bytes", "loss_grad_bytes", "collective_copy", "serial",
                                 "checkpoint_forward_s")

# The functions step_loop calls; numba compiles them with it (``backend.compile_kernels``). Those called
# per event allocate nothing and compile without reference counting: their array arguments would
# otherwise be counted in and out on every call, which doubles the loop's time.
EVENT_HELPERS = (_hold, _record, _all_gather, _compute, _reduce, _wait, _loss)
PHASES = (_forward, _backward)
