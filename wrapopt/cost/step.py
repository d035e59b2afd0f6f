"""The step loop: forward and backward over the segments, on two lanes, and the notes
on how FSDP2 runs a step that it applies.

Two lanes: *compute* (the default stream / the Python thread on CPU) and
*comm* (collectives). ``step_loop`` walks the forward in execution order and
the backward in reverse, placing each unit's all-gather, compute and
reduce-scatter where FSDP2 places them, and tracks memory at every event. The
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
beside the output's gradient, on which FSDP2's hook fires; measured: moe-tiny's
4-block unit peaked in that prefetch). A checkpointed unit first recomputes
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
plan), on every device (measured, 2 gloo ranks: wide-shallow's one unit peaked
in a forward matmul beside that buffer). Backward all-gathers free theirs at
once; a shard group of one gathers nothing.

[Note: collective copies] gloo's all-gather and reduce-scatter allocate a
buffer of the collective's unsharded size while they run, free again by the
time the collective is waited on (measured with the profiler's memory events,
2 ranks: 10 MiB for a 10 MiB all-gather output or reduce-scatter input);
``FabricProfile.collective_copies`` states it per backend (NCCL and
analytical fabrics: 0). So an all-gather holds its output and that copy while
it runs; by its copy-out the copy is gone. A reduce-scatter's copy adds
nothing to its copy-in: FSDP2 frees the unsharded gradients once copied into
the input buffer (``foreach_reduce``), before it runs.

[Note: shard group of one] A shard group of one gathers and reduce-scatters
nothing: no collective copy, no all-gather output kept. It pays the per-unit
overhead all the same: FSDP2's unshard still runs its copy-in, its "all-gather"
of one rank and its copy-out into every parameter. Measured against the plain
model (2 gloo ranks, 40 interleaved steps, max over ranks): no-shard's forward
ran 1.40-1.75 ms over the plain forward (gpt-tiny, llama-tiny) with a unit
overhead of 1.48-1.62 ms. An earlier exemption read a paired comparison with
size-1e8 as no-shard's error, when size-1e8's own forward ran that much over.

[Note: overlap] Collectives are not free when overlapped: a compute segment
that starts while the comm lane is busy runs ``1 + overlap_compute_slowdown``
times longer over the overlapped part, and a collective issued while compute
is busy runs ``1 + overlap_comm_slowdown`` times longer. Both factors are
measured by the profiler.

[Note: checkpoint overhead] Checkpointing a block costs more than its
recomputed forward: ``ComputeProfile.checkpoint_overhead_s`` per checkpointed
block, measured on the model's first block (``measure_checkpoint_overhead``).
Part of it runs in the first forward (the checkpoint's forward hooks and
saved-tensor hooks), ``checkpoint_forward_s``, and the rest in the recompute.
Charged all to the recompute, gpt-tiny's checkpointed plans in ``make demo``
(2 gloo ranks) ran their forward 3.4-3.6 ms over the prediction and their
backward up to 4 ms under it, 4 checkpointed blocks each. Measured on its
block alone the forward's part is 0.24-0.26 of 0.73-0.79 ms (two demo runs):
less than those phases suggest, so some of the checkpointed forward's excess
inside an FSDP step is still not priced; the step's total is unchanged.

[Note: blocking collectives] On a CPU (``ComputeProfile.runs_ahead`` False) a
rank computes nothing while its collectives run: FSDP2 (torch 2.13) issues
its all-gathers with ``unshard_async_op = False``, prefetches included, and
its reduce-scatter and all-reduce without ``async_op``, and a gloo collective
called so returns only when it has ended. So there (``StepConstants.serial``)
compute waits for every collective it issued: a prefetched all-gather, and a
unit's reduction before the unit's post-reduction work; nothing overlaps and
[Note: overlap]'s factors never apply. A GPU's streams run collectives beside
the kernels; there the lanes overlap as above. Measured on 2 gloo ranks
(torch 2.13.0+cpu, 60 paired rounds, twice): gpt-tiny's per-block forward
with an explicit forward prefetch ran +0.04 and +0.31 ms against none, where
the overlapping model had priced the four all-gathers hidden. Replayed on 14
recorded ``make demo`` runs with their own profiles (together with the unit
overhead counted per event: See ``measure_unit_overhead``), the runs whose
every plan lies within 30% went from 8 to 10 of 14; every-leaf's median
measured/predicted from 0.87 to 0.95, the one-unit plans' from 1.16-1.20 to
1.14-1.17.
"""

from __future__ import annotations

from typing import Any

from wrapopt.cost.step_inputs import CK_FULL, CK_SELECTIVE, PlanScalars, Segments, StepConstants, UnitLayout, UnitPlan

__all__ = ["KINDS", "LANES", "LOOP_HELPERS", "step_loop"]

COMPUTE, COMM = 0, 1
LANES = ("compute", "comm")
FWD, LOSS, RECOMPUTE, BWD, ALL_GATHER, REDUCE_SCATTER = range(6)
KINDS = ("fwd", "loss", "recompute", "bwd", "all_gather", "reduce_scatter")


def _rec(ev: Any, ne: int, lane: int, kind: int, u: int, start: float, end: float, m: float) -> int:
    ev[ne, 0] = lane
    ev[ne, 1] = kind
    ev[ne, 2] = u
    ev[ne, 3] = start
    ev[ne, 4] = end
    ev[ne, 5] = m
    return ne + 1


def _all_gather(u, at, dur, nbytes, c, t, ovl_m, static, sharded_grads, gathered, ag_buffer, acts,  # noqa: ANN001
                grads_pending, peak, parts, record, ev, ne, work, copy):
    """Issue unit ``u``'s all-gather (``dur`` seconds, ``nbytes`` gathered) at ``at`` on
    the comm lane, behind what is queued there (See [Note: overlap]), while compute
    holds ``work`` bytes beyond the rest and the collective its own ``copy`` (See
    [Note: collective copies]). Returns (its end, its duration, gathered bytes, peak,
    peak parts, events recorded)."""
    start = at if at > c else c
    d = dur * (ovl_m if t > start else 1.0)
    gathered += nbytes
    held = work + copy * nbytes
    m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + held
    if m > peak:
        peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, held)
    if record and d > 0:
        ne = _rec(ev, ne, COMM, ALL_GATHER, u, start, start + d, m)
    return start + d, d, gathered, peak, parts, ne


def _compute(t, dur, c, ovl_c1, static, sharded_grads, gathered, ag_buffer, acts, grads_pending, work,  # noqa: ANN001
             peak, parts, record, ev, ne, kind, u):
    """Compute of ``dur`` seconds from ``t``, slowed where the comm lane is busy until
    ``c`` (See [Note: overlap]), holding ``work`` bytes beyond the rest. Returns (its
    end, peak, peak parts, events recorded)."""
    start = t
    t += dur
    if c > start:
        t += ((c if c < t else t) - start) * ovl_c1
    m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + work
    if m > peak:
        peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, work)
    if record and t > start:
        ne = _rec(ev, ne, COMPUTE, kind, u, start, t, m)
    return t, peak, parts, ne


# Exempt from the 80-line cap: numba compiles one function, and splitting the loop into
# functions would cost a call per segment in the hot loop (See [Note: compiled step loop]).
def step_loop(segs: Segments, lay: UnitLayout, units: UnitPlan, plan: PlanScalars, k: StepConstants,  # noqa: PLR0913
              ev: Any) -> tuple[Any, ...]:
    """One step's forward and backward over ``segs``, recording events into ``ev`` when
    ``plan.record`` (its rows: at least ``3 * units + 3 * segments + 2``). Takes the named
    tuples or plain tuples in their field order, and returns ``StepResult``'s fields as a
    plain tuple: See [Note: step loop inputs]."""
    # The inputs unpacked in their fields' order (checked below the function): in Python ~0.3 us,
    # against ~1.9 us to name them again and read the names. See [Note: step loop inputs].
    seg_u, seg_f, seg_b, seg_saved, seg_work, seg_gn, seg_bw, seg_keep, seg_sf, seg_sk, seg_so, seg_rf = segs
    order, border, last_fwd, pos, bpos, nseg, seg_grads, tbytes = lay  # UnitLayout
    P, G, ag, rs, ar, rag, keep, ck, poh = units  # UnitPlan
    static, shard, depth, record, gathers = plan  # PlanScalars
    reduce_elem, ovl_c, ovl_m, unit_oh, ck_oh, loss_dur, loss_work, out_b, loss_saved, loss_grads, copy, serial, \
        ck_f = k
    n = len(P)
    nsg = len(seg_u)
    norder = len(order)
    ovl_c1 = ovl_c - 1.0
    sharded_grads = 0.0
    gathered = 0.0
    acts = 0.0
    grads_pending = 0.0
    peak = 0.0
    parts = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    ne = 0
    t = 0.0  # compute lane
    c = 0.0  # comm lane
    comm_total = 0.0

    # ---- forward: See [Note: segments], [Note: all-gather issue] --------------------
    ag_buffer = 0.0  # See [Note: all-gather buffer]: the previous step's last was freed at its forward's end
    # A shard group of one gathers nothing: no output to keep, no copy (See [Note: collective copies]).
    copy = copy if gathers else 0.0
    ag_end = [0.0] * n
    issued = [False] * n
    seen = [False] * n
    u = order[0]
    c, d, gathered, peak, parts, ne = _all_gather(u, 0.0, ag[u], P[u], c, t, ovl_m, static,
        sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne, 0.0, copy)
    comm_total += d
    ag_end[u] = c
    issued[u] = True
    for si in range(nsg):
        u = seg_u[si]
        if not seen[u]:
            seen[u] = True
            if not issued[u]:  # issued when compute reaches the unit
                c, d, gathered, peak, parts, ne = _all_gather(u, t, ag[u], P[u], c, t, ovl_m, static,
                    sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne, 0.0, copy)
                comm_total += d
                ag_end[u] = c
                issued[u] = True
            t = max(t, ag_end[u]) + unit_oh + poh[u]  # See [Note: shard group of one]
            # copy-out: the output beside the unsharded parameters, the previous one freed first
            # (See [Note: all-gather buffer])
            if gathers:
                ag_buffer = 0.0
            m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + P[u]
            if m > peak:
                peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, P[u] * 1.0)
            if gathers:
                ag_buffer = P[u] * 1.0
            if depth:  # prefetch `depth` units ahead, issued at this unit's pre-forward
                k = pos[u] + depth
                if k < norder and not issued[order[k]]:
                    x = order[k]
                    c, d, gathered, peak, parts, ne = _all_gather(x, t, ag[x], P[x], c, t, ovl_m, static,
                        sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne, 0.0, copy)
                    comm_total += d
                    ag_end[x] = c
                    issued[x] = True
                    if serial:  # See [Note: blocking collectives]
                        t = max(t, c)
        # selective-op: its dispatch modes' per-op work on top (See [Note: selective checkpointing]); a checkpointed
        # block's start: its forward's part of the checkpoint's overhead (See [Note: checkpoint overhead])
        t, peak, parts, ne = _compute(t, seg_f[si] + (seg_so[si] if ck[u] == CK_SELECTIVE else 0.0)
                                      + (ck_f if ck[u] and seg_keep[si] else 0.0), c, ovl_c1,
                                      static, sharded_grads, gathered, ag_buffer, acts, grads_pending,
                                      seg_work[si] * 1.0, peak, parts, record, ev, ne, FWD, u)
        # Checkpointing wraps each of the unit's blocks: each keeps only its boundary tensor (full),
        # or that and its saved ops' outputs (selective-op).
        acts += seg_saved[si] if not ck[u] else (seg_keep[si] if ck[u] == CK_FULL else seg_sk[si])
        if si == last_fwd[u]:
            gathered -= P[u] - keep[u]  # reshard after forward
    ag_buffer = 0.0  # the root's post-forward frees the last all-gather output: See [Note: all-gather buffer]
    # See [Note: loss]: forward holds the model's output beside what the loss creates.
    t, peak, parts, ne = _compute(t, loss_dur, c, ovl_c1, static, sharded_grads, gathered, ag_buffer, acts,
                                  grads_pending, loss_work, peak, parts, record, ev, ne, LOSS, n - 1)
    acts += loss_saved
    # the loss's backward: its gradients (the one arriving, the one leaving), beside what it saved
    m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + loss_grads
    if m > peak:
        peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, loss_grads)
    acts -= loss_saved
    fwd_end = t

    # ---- backward: See [Note: backward schedule] --------------------------------------
    bag_end = [0.0] * n
    bissued = [False] * n
    first = [False] * n
    done = [0] * n
    nborder = len(border)
    held, held_end, held_bytes = False, 0.0, 0.0  # the reduce-scatter input FSDP2 still holds
    for si in range(nsg - 1, -1, -1):
        u = seg_u[si]
        if not first[u]:
            first[u] = True
            # See [Note: pre-backward]: the first segment's all-gathers run beside the output's gradient.
            arriving = out_b * 1.0 if si == nsg - 1 else 0.0
            if rag[u] > 0 and not bissued[u]:
                c, d, gathered, peak, parts, ne = _all_gather(u, t, rag[u], P[u] - keep[u], c, t, ovl_m, static,
                    sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne, arriving,
                    copy)
                comm_total += d
                bag_end[u] = c
                bissued[u] = True
            t = max(t, bag_end[u]) + (unit_oh + poh[u] if rag[u] > 0 else 0.0)
            if rag[u] > 0:  # copy-out transient; freed at once in backward
                m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + arriving + P[u]
                if m > peak:
                    peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, arriving + P[u])
            k = bpos[u] + 1  # backward prefetch of the next unit (FSDP2 default)
            if k < nborder:
                x = border[k]
                if rag[x] > 0 and not bissued[x]:
                    c, d, gathered, peak, parts, ne = _all_gather(x, t, rag[x], P[x] - keep[x], c, t, ovl_m, static,
                        sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne, arriving,
                        copy)
                    comm_total += d
                    bag_end[x] = c
                    bissued[x] = True
                    if serial:  # See [Note: blocking collectives]
                        t = max(t, c)
        if ck[u]:  # recompute this block's forward (selective-op: its other ops), re-saving its activations
            full = ck[u] == CK_FULL
            acts += seg_saved[si] - (seg_keep[si] if full else seg_sk[si])
            t, peak, parts, ne = _compute(t, (seg_rf[si] if full else seg_sf[si] + seg_so[si])
                                          + (ck_oh - ck_f if seg_keep[si] else 0.0),
                                          c, ovl_c1, static,
                                          sharded_grads, gathered, ag_buffer, acts, grads_pending, seg_work[si] * 1.0,
                                          peak, parts, record, ev, ne, RECOMPUTE, u)
        # See [Note: progressive backward] for the working set.
        t, peak, parts, ne = _compute(t, seg_b[si], c, ovl_c1, static, sharded_grads, gathered, ag_buffer, acts,
                                      grads_pending, seg_bw[si] * 1.0, peak, parts, record, ev, ne, BWD, u)
        grads_pending += seg_gn[si] * reduce_elem
        acts -= seg_saved[si]
        done[u] += 1
        if done[u] == nseg[u]:
            grads_pending += G[u] - seg_grads[u] * reduce_elem
            gathered -= keep[u] if not rag[u] > 0 else P[u]
            # See [Note: reduce-scatter buffer]: copy-in, then wait for and free the previous one.
            # See [Note: collective copies]: the gradients are freed before the collective's copy.
            m = (static + sharded_grads + gathered + ag_buffer + acts + grads_pending
                 + G[u] * (copy if copy > 1.0 else 1.0))
            if m > peak:
                peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts,
                                  G[u] * (copy if copy > 1.0 else 1.0))
            if held:
                t = max(t, held_end)
                grads_pending -= held_bytes
            # Reduce-scatter, then all-reduce across the replicas (HSDP; shard size 1 is DDP-like).
            start = t if t > c else c
            d = (rs[u] + ar[u]) * (ovl_m if t > start else 1.0)
            c = start + d
            comm_total += d
            sharded_grads += tbytes[u] / shard
            held, held_end, held_bytes = True, c, G[u] * 1.0
            if record and d > 0:
                ne = _rec(ev, ne, COMM, REDUCE_SCATTER, u, start, c, 0.0)
            if serial:  # See [Note: blocking collectives]
                t = max(t, c)
            t += unit_oh + poh[u]
    bwd_end = t
    return fwd_end, bwd_end, max(t, c), comm_total, peak, parts, ne  # StepResult's fields


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

# The functions step_loop calls: numba compiles them with it (``backend.compile_kernels``).
LOOP_HELPERS = (_rec, _all_gather, _compute)
