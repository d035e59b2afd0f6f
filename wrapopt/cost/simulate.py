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
loop is compiled when numba is installed (``_step.py``, [Note: compiled step
loop]; the same source runs as Python otherwise), and what does not depend on
per-unit choices is cached: the layout per set of units (``layout.py``, which
also reuses the split of a block cut into sub-block units across blocks and
plans, [Note: cut pieces]), each unit's bytes and collective times per mesh
(across plans), and the step loop's columns per layout. Caching never changes
a result: a fresh simulator and one that has scored many other plans agree
exactly (``tests/test_cost.py``). ``benchmarks/sim_speed.py`` measures plans
per second, with and without the compiled loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wrapopt.cost import _step
from wrapopt.cost.layout import Layout, Layouts
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
        self._cols: dict[tuple[Any, bool], tuple[tuple[Any, ...], tuple[Any, ...]]] = {}  # per layout

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

    def _columns(self, lay: Layout, mods: tuple[tuple[str, ...], ...], arrays: bool) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """What the step loop reads of a layout: its segments as columns, and
        (order, backward order, then per unit: last forward segment, place in
        forward and backward order, segments, their gradient elements, trainable
        bytes); numpy arrays for the compiled loop. Cached per set of units."""
        key = (mods, arrays)
        hit = self._cols.get(key)
        if hit is None:
            n = len(lay.numel)
            segs = tuple(zip(*lay.segments)) if lay.segments else ((),) * 8
            pos, bpos = [-1] * n, [-1] * n
            for u, k in lay.pos.items():
                pos[u] = k
            for u, k in lay.bpos.items():
                bpos[u] = k
            cols = (lay.order, lay.border, lay.last_fwd_segment, pos, bpos, lay.nseg, lay.seg_grads, lay.trainable_bytes)
            if arrays:
                segs = (np.array(segs[0], dtype=np.int64), *np.array(segs[1:], dtype=np.float64).reshape(7, -1))
                cols = (np.array(cols[0], dtype=np.int64), np.array(cols[1], dtype=np.int64),
                        *np.array(cols[2:6], dtype=np.int64).reshape(4, -1),
                        *np.array(cols[6:], dtype=np.float64).reshape(2, -1))
            if len(self._cols) > 4096:
                self._cols.clear()
            hit = self._cols[key] = (segs, cols)
        return hit

    # -- the step ---------------------------------------------------------------------------

    def simulate(self, plan: PlanSpec, *, record: bool = False) -> CostEstimate:
        """Predict one training step of ``plan`` (see the notes at the top of this file)."""
        units, mesh, opt = plan.units, plan.mesh, self.options
        mods = tuple(u.modules for u in units)
        lay = self.layout(units, mods)
        n = len(units)
        notes: set[str] = set()
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
        optim = trainable * opt.optimizer.states_per_param / shard
        accum = sum(G) if opt.grad_accumulation > 1 else 0  # unsharded grads kept across micro-batches
        static = sharded_params + optim + accum

        # The step loop: See [Note: compiled step loop] in _step.py.
        runs_ahead = not self.compute.device.startswith("cpu")  # See [Note: all-gather issue]
        depth = max(plan.forward_prefetch, 1 if runs_ahead else 0)
        out_b = self.graph.root.output_bytes * opt.batch_scale
        loss_saved = self.graph.loss_saved_bytes * opt.batch_scale
        ck = [u.checkpoint for u in units]
        jit = _step.compiled()
        seg_cols, lay_cols = self._columns(lay, mods, jit is not None)
        unit_cols = (P, G, ag, rs, ar, rag, keep, ck) if jit is None else (
            *np.array((P, G, ag, rs, ar, rag, keep), dtype=np.float64), np.array(ck, dtype=np.bool_))
        cap = 3 * n + 3 * len(lay.segments) + 2 if record else 0
        ev_rows = np.zeros((cap, 6))
        args = (seg_cols, unit_cols + lay_cols[2:], lay_cols[0], lay_cols[1], float(static), float(shard),
                float(reduce_elem), ovl_c, ovl_m, unit_oh, ck_oh, runs_ahead, depth,
                float(self.compute.loss_s * opt.batch_scale),
                float(out_b + self.graph.loss_peak_bytes * opt.batch_scale), float(out_b), float(loss_saved),
                record, ev_rows)
        if jit is not None:
            try:
                res = jit(*args)
            except Exception as e:  # noqa: BLE001 - any compile failure: See [Note: compiled step loop]
                _step.disable_jit(f"{type(e).__name__}: {e}")
                return self.simulate(plan, record=record)
        else:
            res = _step.step_loop(*args)
        fwd_end, bwd_end, end, comm_total, peak, peak_parts, n_ev = res
        ev = [TimelineEvent(_step.LANES[int(r[0])], _step.KINDS[int(r[1])], units[int(r[2])].name, float(r[3]),
                            float(r[4]), int(r[5])) for r in ev_rows[:n_ev]]
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
            peak_breakdown=tuple((k, int(v)) for k, v in zip(_PEAK_PARTS, (sharded_params, peak_parts[0], optim, accum) + peak_parts[1:])),
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

