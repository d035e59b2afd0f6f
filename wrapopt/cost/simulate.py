"""plan -> CostEstimate: an event simulation of one FSDP2 training step, per rank.

Two lanes: *compute* (the default stream / the Python thread on CPU) and
*comm* (collectives). The simulation walks the forward in execution order and
the backward in reverse, placing each unit's all-gather, compute and
reduce-scatter where FSDP2 places them, and tracks memory at every event.
The notes below are the assumptions; code cites them as ``# See [Note: ...]``.
``layout.py`` turns a plan's units into the segments walked here and holds
[Note: segments], [Note: gradient sites] and [Note: progressive backward].

[Note: all-gather issue] A unit's all-gather is issued at its pre-forward.
On a GPU the CPU runs ahead, so the next unit's all-gather is already issued
while this unit computes (FSDP2 lets at most one all-gather run ahead:
depth 1). On CPU (gloo) there is no running ahead: without explicit prefetch
the all-gather is issued when compute reaches the unit, and is exposed.
``PlanSpec.forward_prefetch = k`` issues it k units early
(``set_modules_to_forward_prefetch``). All collectives share one lane and
run in issue order.

[Note: reshard after forward] True frees the gathered parameters after the
unit's last forward segment and re-gathers them in backward; False keeps them
to backward (no second all-gather); an int N keeps a 1/N copy and re-gathers
over N ranks of one node. Plans keep the root unsharded (False), FSDP2's
default for the root.

[Note: backward schedule] Backward walks the segments in reverse. At a
unit's pre-backward FSDP2 issues its all-gather (if resharded) and prefetches
the next unit's in backward order. A checkpointed unit first recomputes its
forward, each checkpointed block paying the profile's measured
``checkpoint_overhead_s`` on top. After the unit's last backward segment its gradients are
reduce-scattered (then all-reduced across the replicate axis under HSDP);
the unsharded gradients live until the next unit's post-backward (See [Note:
reduce-scatter buffer]). The step ends when the last
collective lands, plus the optimizer step (memory-bound on the local shard).

[Note: memory] At any instant: sharded parameters + sharded gradients +
optimizer state (all / shard size) + gathered units + unsharded gradients
awaiting reduce-scatter + saved activations not yet consumed + the working
set of the segment computing now (its largest module output, twice: the
output and the incoming gradient in backward). A checkpointed unit keeps only
its input during forward and re-saves its activations while it recomputes.

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
until its backward, which holds two gradients of the output's size.

[Note: all-gather buffer] On a GPU, FSDP2 keeps the output buffer of a
forward all-gather alive until the next unit's forward all-gather has been
copied out (so the copy-out overlaps the next collective), and the last one
of the forward until the next step's first: one unit's gathered size more,
always, and the whole model for a root-only plan. On CPU (gloo) the
all-gather is asynchronous and the buffer is freed right after the copy-out.
Every copy-out briefly holds the buffer beside the unsharded parameters.

[Note: overlap] Collectives are not free when overlapped: a compute segment
that starts while the comm lane is busy runs ``1 + overlap_compute_slowdown``
times longer over the overlapped part, and a collective issued while compute
is busy runs ``1 + overlap_comm_slowdown`` times longer. Both factors are
measured by the profiler.

[Note: simulator speed] The search scores thousands of plans, so the step
loop is written for speed: per-segment work is inlined (no call per event),
segments are plain tuples, and what does not depend on per-unit choices is
cached: the layout per set of units (``layout.py``), each unit's bytes and
collective times per mesh (across plans), and each segment's backward working
set. Caching never changes a result: a fresh simulator and one that has
scored many other plans agree exactly (``tests/test_cost.py``).
``benchmarks/sim_speed.py`` measures plans per second.
"""

from __future__ import annotations

from typing import Any

from wrapopt.cost.layout import Layouts
from wrapopt.fabric import ComputeProfile, FabricProfile
from wrapopt.types import (
    CostEstimate,
    MeshSpec,
    ModelGraph,
    PlanSpec,
    SimOptions,
    TimelineEvent,
    UnitCost,
)

__all__ = ["simulate", "Simulator"]


_PEAK_PARTS = ("sharded_params", "sharded_grads", "optimizer_state", "accumulated_grads", "unsharded_params",
               "all_gather_buffer", "unsharded_grads", "activations", "working_set")


class Simulator:
    """Scores plans for one model, fabric, compute profile and step options.

    Building one costs a pass over the module graph; ``simulate`` then runs in
    well under a millisecond for a 32-block model (layouts are cached per set
    of units), which keeps the search from ever waiting on the cost model.
    """

    def __init__(self, graph: ModelGraph, fabric: FabricProfile, compute: ComputeProfile, options: SimOptions | None = None):
        self.graph, self.fabric, self.compute = graph, fabric, compute
        self.options = options or SimOptions()
        self.layout = Layouts(graph, compute, self.options)
        self._elem = self.layout.elem  # storage bytes per element
        self._colls: dict[tuple[str, int, int, float], tuple[float, str | None]] = {}  # collective times by size
        self._unit_colls: dict[tuple[Any, MeshSpec], tuple[Any, ...]] = {}  # per set of units
        self._per_unit: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # the same per unit, across sets
        self._num_tensors = len(graph.param_shapes)

    # -- collectives ----------------------------------------------------------------------

    def _coll(self, name: str, group: int, rpn_in_group: int, nbytes: float, notes: set[str]) -> float:
        key = (name, group, rpn_in_group, nbytes)
        hit = self._colls.get(key)
        if hit is None:
            if len(self._colls) > 65536:
                self._colls.clear()
            hit = self._colls[key] = self.fabric.collective_s(name, group, rpn_in_group, nbytes)
        t, caveat = hit
        if caveat:
            notes.add(caveat)
        return t

    # -- the step ---------------------------------------------------------------------------

    def simulate(self, plan: PlanSpec, *, record: bool = False) -> CostEstimate:
        """Predict one training step of ``plan`` (see the notes at the top of this file)."""
        units, mesh, opt = plan.units, plan.mesh, self.options
        mods = tuple(u.modules for u in units)
        lay = self.layout(units, mods)
        n = len(units)
        notes: set[str] = set()
        ev: list[TimelineEvent] = []
        shard = mesh.shard_size
        gather_elem = opt.param_dtype_bytes or self._elem
        reduce_elem = opt.reduce_dtype_bytes or gather_elem
        rpn_shard = min(shard, mesh.ranks_per_node)
        rpn_rep = 1 if shard >= mesh.ranks_per_node else max(1, mesh.ranks_per_node // shard)
        ovl_c = 1.0 + self.fabric.overlap_compute_slowdown
        ovl_m = 1.0 + self.fabric.overlap_comm_slowdown
        unit_oh = self.compute.unit_overhead_s
        ck_oh = self.compute.checkpoint_overhead_s  # per checkpointed block (a segment that starts a piece)

        ckey = (mods, mesh)
        cached = self._unit_colls.get(ckey)
        if cached is None:  # per set of units and mesh: bytes and collective times of every unit
            per_unit = self._per_unit
            mkey = (mesh.world_size, mesh.ranks_per_node, shard)
            cn: set[str] = set()
            cols = []
            for i, u in enumerate(units):
                ukey = (mods[i], mkey, lay.numel[i], lay.trainable_numel[i], lay.fwd_s[i], lay.bwd_s[i], lay.saved[i])
                hit = per_unit.get(ukey)
                if hit is None:
                    un: set[str] = set()
                    p_i = lay.numel[i] * gather_elem  # gathered bytes
                    g_i = lay.trainable_numel[i] * reduce_elem  # unsharded grad bytes
                    ag_i = self._coll("all_gather", shard, rpn_shard, p_i, un)
                    rs_i = self._coll("reduce_scatter", shard, rpn_shard, g_i, un)
                    ar_i = self._coll("all_reduce", mesh.world_size // shard, rpn_rep, g_i / shard, un)
                    hit = (p_i, g_i, ag_i, rs_i, ar_i, UnitCost(u.name, int(p_i), lay.fwd_s[i], lay.bwd_s[i], ag_i, rs_i,
                                                                 lay.saved[i]), tuple(un))
                    if len(per_unit) > 65536:
                        per_unit.clear()
                    per_unit[ukey] = hit
                cols.append(hit)
                cn.update(hit[6])
            if len(self._unit_colls) > 4096:
                self._unit_colls.clear()
            P, G, ag, rs, ar, ucosts = ([h[k] for h in cols] for k in range(6))
            cached = self._unit_colls[ckey] = (P, G, ag, rs, ar, frozenset(cn), tuple(ucosts))
        P, G, ag, rs, ar, cnotes, ucosts = cached
        notes.update(cnotes)
        rag = [0.0] * n  # backward re-gather cost per unit
        keep = [0] * n  # bytes kept between forward and backward
        for i, u in enumerate(units):
            raf = u.reshard_after_forward
            if raf is False:
                keep[i] = P[i]
            elif raf is True:
                rag[i] = ag[i]
            else:  # int: keep a 1/N copy, re-gather within N ranks (See [Note: reshard after forward])
                keep[i] = P[i] // max(1, raf) if raf < shard else P[i]  # each rank keeps 1/N
                rag[i] = self._coll("all_gather", raf, min(raf, mesh.ranks_per_node), P[i], notes) if raf > 1 else 0.0

        # Static memory: See [Note: memory].
        storage = sum(lay.storage_bytes)
        trainable = sum(lay.trainable_bytes)
        sharded_params = storage / shard
        # Sharded gradients appear unit by unit as reduce-scatters land (zero_grad(set_to_none=True)).
        sharded_grads = 0.0
        optim = trainable * opt.optimizer.states_per_param / shard
        accum = sum(G) if opt.grad_accumulation > 1 else 0  # unsharded grads kept across micro-batches
        static = sharded_params + optim + accum
        gathered = 0.0
        acts = 0.0
        peak = 0.0
        peak_parts: tuple[float, ...] = ()
        grads_pending = 0.0

        def note_mem(work: float) -> float:
            nonlocal peak, peak_parts
            total = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + work
            if total > peak:
                peak = total
                peak_parts = (sharded_grads, gathered, ag_buffer, grads_pending, acts, work)
            return total

        # ---- forward: See [Note: segments], [Note: all-gather issue] -------------------
        order = lay.order
        runs_ahead = not self.compute.device.startswith("cpu")  # See [Note: all-gather issue]
        # The previous step's last forward all-gather output is still held at step start.
        ag_buffer = float(P[order[-1]]) if runs_ahead else 0.0
        pos = lay.pos
        depth = max(plan.forward_prefetch, 1 if runs_ahead else 0)
        ag_end = [0.0] * n
        issued = [False] * n
        t = 0.0  # compute lane
        c = 0.0  # comm lane
        comm_total = 0.0

        def issue_ag(u: int, at: float, kind: str = "all_gather", dur: float | None = None) -> float:
            nonlocal c, gathered, comm_total
            d = ag[u] if dur is None else dur
            start = max(at, c)
            d = d * (ovl_m if t > start else 1.0)
            c = start + d
            comm_total += d
            gathered += P[u] if kind == "all_gather" else P[u] - keep[u]
            m = note_mem(0)
            if record and d > 0:
                ev.append(TimelineEvent("comm", "all_gather", units[u].name, start, c, int(m)))
            return c

        def run(dur: float, kind: str, u: int, work: float) -> None:
            nonlocal t
            start = t
            t += dur
            if c > start:  # comm overlapping this compute
                t += ((c if c < t else t) - start) * (ovl_c - 1.0)
            m = note_mem(work)
            if record and t > start:
                ev.append(TimelineEvent("compute", kind, units[u].name, start, t, int(m)))

        # The per-segment steps below inline run() and note_mem(): they are the
        # search's inner loop (See [Note: simulator speed]). Per-unit events call them.
        ovl_c1 = ovl_c - 1.0
        ck_unit = [u.checkpoint for u in units]
        last_fwd = lay.last_fwd_segment
        ag_end[order[0]] = issue_ag(order[0], 0.0)
        issued[order[0]] = True
        seen_first = [False] * n
        for si, (u, fwd_s, _b, saved, work, _g, _bw, kept) in enumerate(lay.segments):
            if not seen_first[u]:
                seen_first[u] = True
                if not issued[u]:
                    ag_end[u] = issue_ag(u, t)
                    issued[u] = True
                t = max(t, ag_end[u]) + unit_oh
                note_mem(P[u])  # copy-out: the all-gather output beside the unsharded parameters
                if runs_ahead:
                    ag_buffer = P[u]  # See [Note: all-gather buffer]
                # Prefetch `depth` units ahead, issued now (this unit's pre-forward).
                if depth:
                    k = pos[u] + depth
                    if k < len(order) and not issued[order[k]]:
                        nxt = order[k]
                        ag_end[nxt] = issue_ag(nxt, t)
                        issued[nxt] = True
            start = t  # run(fwd_s, "fwd", u, work)
            t += fwd_s
            if c > start:  # comm overlapping this compute
                t += ((c if c < t else t) - start) * ovl_c1
            m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + work
            if m > peak:
                peak, peak_parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, work)
            if record and t > start:
                ev.append(TimelineEvent("compute", "fwd", units[u].name, start, t, int(m)))
            # Checkpointing wraps each of the unit's modules: each keeps only its boundary tensor.
            acts += kept if ck_unit[u] else saved
            if si == last_fwd[u]:
                gathered -= P[u] - keep[u]  # reshard after forward
        # See [Note: loss]: forward holds the model's output beside what the loss creates.
        out_b = self.graph.root.output_bytes * opt.batch_scale
        loss_saved = self.graph.loss_saved_bytes * opt.batch_scale
        run(self.compute.loss_s * opt.batch_scale, "loss", n - 1, out_b + self.graph.loss_peak_bytes * opt.batch_scale)
        acts += loss_saved
        note_mem(2 * out_b)  # the loss's backward: the gradient arriving and the one leaving, beside its saved
        acts -= loss_saved
        fwd_end = t

        # ---- backward: See [Note: backward schedule] ---------------------------------------
        border, bpos, nseg, seg_grads = lay.border, lay.bpos, lay.nseg, lay.seg_grads
        bag_end = [0.0] * n
        bissued = [False] * n
        first_b = [False] * n
        done_segments = [0] * n
        held: tuple[float, float] | None = None  # (end, bytes) of the reduce-scatter input FSDP2 still holds

        for u, fwd_s, bwd_s, saved, work, grad_numel, bwd_work, kept in reversed(lay.segments):
            if not first_b[u]:
                first_b[u] = True
                if rag[u] > 0 and not bissued[u]:
                    bag_end[u] = issue_ag(u, t, "re_gather", rag[u])
                    bissued[u] = True
                t = max(t, bag_end[u]) + (unit_oh if rag[u] > 0 else 0.0)
                if rag[u] > 0:
                    note_mem(P[u])  # copy-out transient; freed at once in backward
                k = bpos[u] + 1  # backward prefetch of the next unit (FSDP2 default)
                if k < len(border) and rag[border[k]] > 0 and not bissued[border[k]]:
                    bag_end[border[k]] = issue_ag(border[k], t, "re_gather", rag[border[k]])
                    bissued[border[k]] = True
            # Unsharded gradients appear as the unit's backward reaches their modules
            # (the rest of the unit's, e.g. of modules that never ran, at its end).
            if ck_unit[u]:  # recompute this block's forward, re-saving its activations
                acts += saved - kept
                run(fwd_s + (ck_oh if kept else 0.0), "recompute", u, work)
            start = t  # run(bwd_s, "bwd", u, bwd_work): See [Note: progressive backward]
            t += bwd_s
            if c > start:
                t += ((c if c < t else t) - start) * ovl_c1
            m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + bwd_work
            if m > peak:
                peak, peak_parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, bwd_work)
            if record and t > start:
                ev.append(TimelineEvent("compute", "bwd", units[u].name, start, t, int(m)))
            grads_pending += grad_numel * reduce_elem
            acts -= saved
            done_segments[u] += 1
            if done_segments[u] == nseg[u]:
                grads_pending += G[u] - seg_grads[u] * reduce_elem
                gathered -= keep[u] if not rag[u] > 0 else P[u]
                # See [Note: reduce-scatter buffer]: copy-in, then wait for and free the previous one.
                note_mem(G[u])
                if held is not None:
                    t = max(t, held[0])
                    grads_pending -= held[1]
                # Reduce-scatter, then all-reduce across the replicas (HSDP; shard size 1 is DDP-like).
                dur = rs[u] + ar[u]
                start = max(t, c)
                d = dur * (ovl_m if t > start else 1.0)
                c = start + d
                comm_total += d
                sharded_grads += lay.trainable_bytes[u] / shard
                held = (c, G[u])
                if record and d > 0:
                    ev.append(TimelineEvent("comm", "reduce_scatter", units[u].name, start, c, 0))
                t += unit_oh
        if held is not None:  # the end of backward waits for the last one and frees it
            grads_pending -= held[1]
        bwd_end = t
        end = max(t, c)
        # Optimizer: read/write the local shard and its states (memory-bound), plus a
        # fixed dispatch cost per parameter tensor (dominant for small models).
        # Both calibrated by the profiler's AdamW steps on fully_shard parameters, the
        # per-tensor cost separately for 2-D meshes (HSDP, no-shard): see
        # profile/compute.py::measure_optimizer.
        cp = self.compute
        optim_s = (storage / shard) * (2 + 2 * opt.optimizer.states_per_param) / (
            cp.optimizer_bandwidth_bytes_per_s or cp.memory_bandwidth_bytes_per_s)
        if opt.optimizer.states_per_param:
            per_tensor = (cp.optimizer_tensor_2d_s or cp.optimizer_tensor_s) if mesh.is_hsdp else cp.optimizer_tensor_s
            optim_s += self._num_tensors * per_tensor
        step = end + optim_s
        if record:
            ev.append(TimelineEvent("compute", "optim", "<all>", end, step, int(static)))

        micro = opt.grad_accumulation
        if micro > 1:
            # Earlier micro-batches: the same forward and backward without the
            # reduce-scatters (set_requires_gradient_sync(False)).
            step += (micro - 1) * bwd_end
        ckpt = [i for i in range(n) if units[i].checkpoint]
        compute_s = sum(lay.fwd_s) + sum(lay.bwd_s) + sum(lay.fwd_s[i] for i in ckpt)
        if ckpt and ck_oh:
            compute_s += ck_oh * sum(1 for sg in lay.segments if sg.keep and units[sg.unit].checkpoint)
        compute_s += self.compute.loss_s * opt.batch_scale
        compute_s *= micro
        exposed = max(0.0, step - compute_s - optim_s)
        return CostEstimate(
            step_s=step,
            fwd_s=fwd_end,
            bwd_s=bwd_end - fwd_end,
            compute_s=compute_s,
            comm_s=comm_total,
            exposed_comm_s=exposed,
            peak_bytes=int(peak),
            peak_breakdown=tuple((k, int(v)) for k, v in zip(_PEAK_PARTS, (sharded_params, (peak_parts or (0.0,))[0], optim, accum) + (peak_parts or (0.0,) * 6)[1:])),
            units=ucosts,
            timeline=tuple(ev),
            notes=tuple(sorted(notes)),
            optim_s=optim_s,
        )


def simulate(
    graph: ModelGraph,
    plan: PlanSpec,
    fabric: FabricProfile,
    compute: ComputeProfile,
    options: SimOptions | None = None,
    *,
    record: bool = False,
) -> CostEstimate:
    """One-shot form of ``Simulator(graph, fabric, compute, options).simulate(plan)``.

    The plan is validated first (``PlanError`` names the offending modules).

    Example:
        >>> from wrapopt import zoo, trace_model
        >>> from wrapopt.fabric import analytical_fabric, ComputeProfile
        >>> from wrapopt.search.baselines import baselines
        >>> model, x = zoo.build("gpt-tiny", "meta")
        >>> g = trace_model(model, x)
        >>> from wrapopt.types import MeshSpec
        >>> mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
        >>> plan = baselines(g, mesh)["per-block"]
        >>> est = simulate(g, plan, analytical_fabric(world_size=8), ComputeProfile.analytical())
        >>> est.step_s > 0
        True
    """
    from wrapopt.units import validate_plan

    validate_plan(graph, plan)
    return Simulator(graph, fabric, compute, options).simulate(plan, record=record)

