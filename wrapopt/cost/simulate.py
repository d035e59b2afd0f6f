"""plan -> CostEstimate: an event simulation of one FSDP2 training step, per rank.

Two lanes: *compute* (the default stream / the Python thread on CPU) and
*comm* (collectives). The simulation walks the forward in execution order and
the backward in reverse, placing each unit's all-gather, compute and
reduce-scatter where FSDP2 places them, and tracks memory at every event.
The notes below are the assumptions; code cites them as ``# See [Note: ...]``.
``layout.py`` turns a plan's units into the segments walked here ([Note:
segments]); ``calls.py`` holds [Note: gradient sites], [Note: progressive backward].

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
the next unit's in backward order ([Note: pre-backward] the first of these
beside the output's gradient, on which FSDP2's hook fires; measured: moe-tiny's
4-block unit peaked in that prefetch). A checkpointed unit first recomputes
its forward, each checkpointed block paying the profile's measured
``checkpoint_overhead_s`` on top. After the unit's last backward segment its
gradients are reduce-scattered (then all-reduced across the replicate axis
under HSDP); the unsharded gradients live until the next unit's
post-backward (See [Note: reduce-scatter buffer]). The step ends when the
last collective lands, plus the optimizer step (memory-bound on the local shard).

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

[Note: all-gather buffer] FSDP2 (torch 2.13, ``wait_for_unshard``) keeps a
forward all-gather's output after its copy-out, to overlap the copy-out with
the next collective, and frees it just before the next unit's copy-out; the
root's post-forward frees the last one. So while forward computes, the unit
before holds its gathered size once more (the whole model for a root-only
plan), on every device (measured, 2 gloo ranks: wide-shallow's one unit peaked
in a forward matmul beside that buffer). Backward all-gathers free theirs at
once; a shard group of one gathers nothing.

[Note: overlap] Collectives are not free when overlapped: a compute segment
that starts while the comm lane is busy runs ``1 + overlap_compute_slowdown``
times longer over the overlapped part, and a collective issued while compute
is busy runs ``1 + overlap_comm_slowdown`` times longer. Both factors are
measured by the profiler.

[Note: accumulation sync] With k micro-batches per step FSDP2 can
synchronise gradients two ways. ``every``: each micro-batch reduce-scatters
its gradients and accumulates them into the sharded gradients, so the step is
k whole forward-backward passes with their collectives, and from the second
micro-batch on the sharded gradients are all there. ``last``
(``set_requires_gradient_sync(False)`` on all but the last, FSDP1's
``no_sync``): earlier micro-batches skip the reduce-scatters, and each unit's
unsharded gradients (in the reduce dtype) stay allocated across micro-batches
until the last one reduce-scatters them: the breakdown's
``accumulated_grads``. That saves k-1 rounds of reduce-scatters and costs the
whole model's unsharded gradients in memory. The earlier micro-batches are
timed as the synchronised one's forward and backward. Unset
(``SimOptions.accumulation_sync = None``), both are scored and the estimate is
the faster that fits ``memory_budget_bytes`` (else the smaller peak);
``CostEstimate.accumulation_sync`` says which.

[Note: simulator speed] The search scores thousands of plans, so with numba
installed three pieces are compiled (``step.py``, [Note: compiled step loop]):
the step loop, the layout build (``layout.py``, [Note: layout kernel]) and the
lookup of collective times; without numba the same step loop runs as Python
and layouts reuse block cuts across blocks and plans ([Note: cut pieces]).
Per-unit figures are numpy columns, and what does not depend on per-unit
choices is cached: per set of units its layout and sums, per mesh its bytes,
collective times and ``UnitCosts`` (made into ``UnitCost`` items only when
read), and per collective and group a table of times by message size.
Caching never changes a result: a fresh simulator and one that has scored
many other plans agree exactly (``tests/cost/test_simulate.py``). A plan
whose layout is cached scores in ~25 us, so the records made per plan are
named tuples built by ``tuple.__new__`` from their fields in order ([Note:
step loop inputs] in ``step.py``), and a collective over one rank is not
looked up (it is 0 s). ``benchmarks/sim_speed.py`` measures plans per
second, compiled and Python; ``benchmarks/sim_speed_ab.py`` compares two
checkouts in paired CPU time.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from wrapopt.cost import step as steploop
from wrapopt.cost.layout import (
    KEEPS,
    NUMEL,
    SAVED,
    STORAGE,
    TRAINABLE_BYTES,
    TRAINABLE_NUMEL,
    Layout,
    Layouts,
    unit_modules,
)
from wrapopt.cost.tp import tp_view
from wrapopt.cost.step import Backend, PlanScalars, Segments, StepConstants, StepResult, UnitLayout, UnitPlan
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.cost.dtypes import in_compute_dtype, optimizer_states_per_param, trainable_tensors
from wrapopt.spec import SYNC_MODES, CostEstimate, ModelGraph, OptimizerKind, PlanSpec, SimOptions, TimelineEvent, UnitCosts
from wrapopt.tp import TPSpec
from wrapopt.units import validate_plan

__all__ = ["simulate", "Simulator"]

_RESHARD, _CHECKPOINT = operator.attrgetter("reshard_after_forward"), operator.attrgetter("checkpoint")

_NO_EVENTS = np.zeros((0, 6))  # the step loop's events when none are recorded: it writes none

# Builds a named tuple from a tuple of its fields in order: ~0.15 us against ~0.3 us for keywords and
# ~0.2 us for ``_make``. The per-plan records below are built this way: See [Note: simulator speed].
_new = tuple.__new__

_PEAK_PARTS = ("sharded_params", "sharded_grads", "optimizer_state", "accumulated_grads", "unsharded_params",
               "all_gather_buffer", "unsharded_grads", "activations", "working_set")


class _MeshCosts(NamedTuple):
    """Per set of units and mesh: the units' bytes and collective times."""

    gathered_bytes: np.ndarray
    grad_bytes: np.ndarray
    all_gather_s: np.ndarray
    units: UnitCosts  # what ``CostEstimate.units`` reports
    notes: frozenset[str]
    # the first five columns of ``UnitPlan`` (gathered and gradient bytes, all-gather, reduce-scatter,
    # all-reduce times), as rows of one float64 array
    columns: tuple[np.ndarray, ...]


class _Run(NamedTuple):
    """One scoring of a plan in one accumulation mode: See [Note: accumulation sync]."""

    mode: str | None  # 'every', 'last', or None (no accumulation)
    static_bytes: float  # the step loop's static memory
    held_bytes: float  # unsharded gradients held across micro-batches
    sharded_grads_bytes: float  # sharded gradients in place before backward
    events: np.ndarray  # the step loop's recorded events
    result: StepResult


class _UnitSet(NamedTuple):
    """Per set of units: what every plan of these units shares. See [Note: simulator speed]."""

    layout: Layout
    storage_bytes: int
    trainable_bytes: int
    compute_s: float  # forward and backward, once
    per_mesh: dict[Any, _MeshCosts]


class Simulator:
    """Scores plans for one model, fabric, compute profile and step options.

    Building one costs a pass over the module graph; ``simulate`` then runs in
    well under a millisecond for a 32-block model (layouts are cached per set
    of units), which keeps the search from ever waiting on the cost model.
    """

    def __init__(self, graph: ModelGraph, fabric: FabricProfile, compute: ComputeProfile, options: SimOptions | None = None,
                 *, backend: str | Backend | None = None):
        """``backend``: 'compiled' (numba), 'python', a ``Backend``, or None for the default:
        compiled when numba is installed, unless ``WRAPOPT_JIT=0``. See [Note: compiled step loop]."""
        self.options = options or SimOptions()
        self.traced = graph  # as traced (before the compute dtype): the tensor-parallel views start from it
        self._tp_views: dict[tuple[Any, int], tuple[Simulator, frozenset[str]]] = {}
        # See [Note: compute dtype] in dtypes.py: activations in the mixed-precision dtype.
        graph = in_compute_dtype(graph, self.options.activation_dtype_bytes, self.options.output_dtype_bytes)
        self.graph, self.fabric, self.compute = graph, fabric, compute
        self._states = optimizer_states_per_param(graph, self.options.optimizer)  # optimizer state per element
        self._stepping = self.options.optimizer is not OptimizerKind.NONE
        # See [Note: accumulation sync]: the modes each plan is scored in.
        micro, sync = self.options.grad_accumulation, self.options.accumulation_sync
        self._modes = (None,) if micro == 1 else (sync,) if sync else SYNC_MODES
        self.backend = Backend.of(backend)
        self.layout = Layouts(graph, compute, self.options, backend=self.backend)
        self._elem = self.layout.elem  # storage bytes per element
        self._colls: dict[tuple[str, int, int, float], tuple[float, str | None]] = {}  # collective times by size
        self._tables: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray, dict[float, set[str]]]] = {}  # the same
        self._sets: dict[tuple[tuple[str, ...], ...], _UnitSet] = {}  # per set of units (and mesh)
        self._num_tensors = trainable_tensors(graph)  # the optimizer steps these only
        self._runs_ahead = compute.runs_ahead  # See [Note: all-gather issue]
        self._gather_elem = self.options.param_dtype_bytes or self._elem  # bytes per element all-gathered
        self._reduce_elem = self.options.reduce_dtype_bytes or self._gather_elem  # and reduce-scattered
        scale, out_b = self.options.batch_scale, graph.root.output_bytes * self.options.batch_scale
        self._constants = StepConstants(
            reduce_elem_bytes=float(self._reduce_elem),
            overlap_compute=1.0 + fabric.overlap_compute_slowdown,  # See [Note: overlap]
            overlap_comm=1.0 + fabric.overlap_comm_slowdown,
            unit_overhead_s=compute.unit_overhead_s,
            checkpoint_overhead_s=compute.checkpoint_overhead_s,  # per checkpointed block (a segment that starts a piece)
            # See [Note: loss]: its time, the memory while it runs, the model's output, what it saves.
            loss_s=float(compute.loss_s * scale), loss_work_bytes=float(out_b + graph.loss_peak_bytes * scale),
            output_bytes=float(out_b), loss_saved_bytes=float(graph.loss_saved_bytes * scale),
            collective_copy=float(fabric.collective_copies))  # See [Note: collective copies]
        self._cols: dict[tuple[Any, bool], tuple[Segments, UnitLayout]] = {}  # per layout

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

    def _colls_of(self, name: str, group: int, rpn_in_group: int, nbytes: np.ndarray, notes: set[str]) -> np.ndarray:
        """``_coll`` of every size in ``nbytes``, from a table per collective and group:
        its sizes sorted, their times, and the caveats of extrapolated sizes."""
        if group <= 1:  # one rank moves nothing: FabricProfile.collective_s is 0 s with no caveat (full-shard all-reduce)
            return np.zeros(nbytes.shape[0])
        key = (name, group, rpn_in_group)
        sizes, times, caveats = self._tables.get(key) or (np.zeros(0), np.zeros(0), {})
        fns = self.backend.kernels
        lookup, merge = (fns.lookup, fns.merge) if fns else (steploop.lookup, steploop.merge)
        try:
            out, missing = lookup(sizes, times, nbytes)
            if missing:  # new sizes: add them to the table
                if len(sizes) > 65536:
                    sizes, times, caveats = np.zeros(0), np.zeros(0), {}
                # the missing sizes once each, ascending (np.unique takes ~4 us, a set ~1 us)
                new = sorted(set(nbytes[np.isnan(out)].tolist()))
                made = []
                for b in new:
                    extra: set[str] = set()
                    made.append(self._coll(name, group, rpn_in_group, b, extra))
                    if extra:
                        caveats[b] = extra
                sizes, times = merge(sizes, times, np.array(new, dtype=np.float64), np.array(made, dtype=np.float64))
                self._tables[key] = (sizes, times, caveats)
                out, missing = lookup(sizes, times, nbytes)
        except Exception as e:  # noqa: BLE001 - any compile failure: See [Note: compiled step loop]
            if fns is None:
                raise
            self.backend.fall_back(f"{type(e).__name__}: {e}")
            return self._colls_of(name, group, rpn_in_group, nbytes, notes)
        if caveats:  # extrapolated sizes: See FabricProfile.collective_s
            for b in caveats.keys() & set(nbytes.tolist()):
                notes.update(caveats[b])
        return out

    def _columns(self, lay: Layout, mods: tuple[tuple[str, ...], ...], arrays: bool) -> tuple[Segments, UnitLayout]:
        """``lay.seg_cols`` and ``lay.unit_cols``: numpy arrays for the compiled loop, tuples
        for the Python one. Converted (and cached per set of units) when the layout holds the other kind."""
        if isinstance(lay.seg_cols.unit, np.ndarray) == arrays:
            return lay.seg_cols, lay.unit_cols
        key = (mods, arrays)
        hit = self._cols.get(key)
        if hit is None:
            segs, cols = lay.seg_cols, lay.unit_cols
            if arrays:  # as the layout kernel makes them: See [Note: layout kernel]
                segs = Segments(np.array(segs.unit, dtype=np.int64), *np.array(segs[1:], dtype=np.float64).reshape(7, -1))
                cols = UnitLayout(np.array(cols.forward, dtype=np.int64), np.array(cols.backward, dtype=np.int64),
                                  *np.array(cols[2:6], dtype=np.int64).reshape(4, -1),
                                  *np.array(cols[6:], dtype=np.float64).reshape(2, -1))
            else:
                segs, cols = Segments._make(tuple(c.tolist()) for c in segs), UnitLayout._make(tuple(c.tolist()) for c in cols)
            if len(self._cols) > 4096:
                self._cols.clear()
            hit = self._cols[key] = (segs, cols)
        return hit

    # -- tensor parallelism -------------------------------------------------------------------

    def for_tp(self, spec: TPSpec, size: int) -> tuple["Simulator", frozenset[str]]:
        """The simulator of one tensor-parallel rank's share of the model (scores plans on the
        data-parallel mesh), and the view's caveats. See [Note: tensor parallel costs] in tp.py."""
        key = (spec, size)
        hit = self._tp_views.get(key)
        if hit is None:
            # The same global batch as a 1-D plan: a tensor-parallel group runs ``size`` ranks' batches.
            opts = replace(self.options, batch_scale=self.options.batch_scale * size)
            g, c, notes = tp_view(self.traced, self.compute, self.fabric, spec, size, batch_scale=opts.batch_scale,
                                  activation_dtype_bytes=opts.activation_dtype_bytes)
            hit = self._tp_views[key] = (Simulator(g, self.fabric, c, opts, backend=self.backend), notes)
        return hit

    # -- the step ---------------------------------------------------------------------------

    def simulate(self, plan: PlanSpec, *, record: bool = False) -> CostEstimate:
        """Predict one training step of ``plan`` (see the notes at the top of this file)."""
        if plan.tp is not None:  # FSDP on the data-parallel mesh of one tensor-parallel rank's model
            sub, tp_notes = self.for_tp(plan.tp, plan.mesh.tp_size)
            est = sub.simulate(replace(plan, mesh=plan.mesh.data_parallel(), tp=None), record=record)
            return replace(est, notes=tuple(sorted(set(est.notes) | tp_notes))) if tp_notes else est
        units, mesh, opt = plan.units, plan.mesh, self.options
        mods = tuple(map(unit_modules, units))
        per_set = self._sets.get(mods)
        if per_set is None:  # what every plan of these units shares: See [Note: simulator speed]
            lay = self.layout.build(units, mods)  # not via the layout cache: this one is the cache
            if len(self._sets) > 4096:
                self._sets.clear()
            storage, trainable = lay.counts[STORAGE:TRAINABLE_BYTES + 1:TRAINABLE_BYTES - STORAGE].sum(1).tolist()
            fwd, bwd = lay.times.tolist()
            per_set = self._sets[mods] = _new(_UnitSet, (lay, storage, trainable, sum(fwd) + sum(bwd), {}))  # its fields
        lay, storage, trainable = per_set.layout, per_set.storage_bytes, per_set.trainable_bytes
        n = len(units)
        notes: set[str] = set()
        shard = mesh.shard_size
        gather_elem, reduce_elem = self._gather_elem, self._reduce_elem

        cached = per_set.per_mesh.get(mesh)
        if cached is None:  # per set of units and mesh: bytes and collective times of every unit
            rpn_shard = min(shard, mesh.ranks_per_node)
            rpn_rep = 1 if shard >= mesh.ranks_per_node else max(1, mesh.ranks_per_node // shard)
            P = lay.counts[NUMEL] * gather_elem  # gathered bytes
            G = lay.counts[TRAINABLE_NUMEL] * reduce_elem  # unsharded grad bytes
            cn: set[str] = set()
            ag = self._colls_of("all_gather", shard, rpn_shard, P, cn)
            rs = self._colls_of("reduce_scatter", shard, rpn_shard, G, cn)
            ar = self._colls_of("all_reduce", mesh.world_size // shard, rpn_rep, G / shard, cn)
            columns = (P, G, ag, rs, ar)
            if not all(c.dtype == np.float64 for c in columns):  # P and G are integers for an integer dtype size
                columns = tuple(np.array(columns, dtype=np.float64))
            cached = per_set.per_mesh[mesh] = _new(_MeshCosts, (  # in _MeshCosts' field order
                P, G, ag, UnitCosts(units, P, lay.times[0], lay.times[1], ag, rs, lay.counts[SAVED]), frozenset(cn), columns))
        P, G, ag = cached.gathered_bytes, cached.grad_bytes, cached.all_gather_s
        notes.update(cached.notes)
        # Per-unit choices: See [Note: reshard after forward].
        rafs = list(map(_RESHARD, units))
        code = np.array([-1 if r is True else r for r in rafs], dtype=np.int64)  # True: -1, False: 0, else N
        rag = np.where(code < 0, ag, 0.0)  # backward re-gather cost per unit
        keep = np.where(code == 0, P, 0.0)  # bytes kept between forward and backward
        if code.max() > 0:  # N: each rank keeps 1/N and re-gathers within N ranks
            for raf in np.unique(code[code > 0]).tolist():
                at = np.flatnonzero(code == raf)
                keep[at] = P[at] // raf if raf < shard else P[at]
                if raf > 1:
                    rag[at] = self._colls_of("all_gather", raf, min(raf, mesh.ranks_per_node), P[at], notes)
        cks = list(map(_CHECKPOINT, units))
        ck = np.array(cks, dtype=np.bool_)
        any_ck = any(cks)

        # Static memory: See [Note: memory].
        sharded_params = storage / shard
        # Sharded gradients appear unit by unit as reduce-scatters land (zero_grad(set_to_none=True)).
        optim = trainable * self._states / shard
        micro = opt.grad_accumulation
        # See [Note: accumulation sync]: which modes to score.
        modes = self._modes

        # The step loop: See [Note: compiled step loop] and [Note: step loop inputs] in step.py.
        backend = self.backend
        compiled = backend.kernels is not None
        seg_cols, lay_cols = self._columns(lay, mods, compiled)
        unit_cols = (*cached.columns, rag, keep, ck)  # UnitPlan's fields
        unit_cols = _new(UnitPlan, unit_cols if compiled else [c.tolist() for c in unit_cols])
        depth = max(plan.forward_prefetch, 1 if self._runs_ahead else 0)
        runs = []
        for mode in modes:
            if mode == "every":
                # Later micro-batches start with every sharded gradient in place (the loop
                # adds none: an infinite shard); no unsharded gradients are held.
                held, static, loop_shard, sharded_grads = 0, sharded_params + optim + trainable / shard, float("inf"), trainable / shard
            else:
                held = sum(G.tolist()) if micro > 1 else 0  # unsharded grads held across micro-batches (no-sync)
                static, loop_shard, sharded_grads = sharded_params + optim + held, float(shard), 0
            scalars = _new(PlanScalars, (float(static), loop_shard, depth, record, bool(shard > 1)))  # in field order
            ev_rows = np.zeros((3 * n + 3 * lay.num_segments + 2, 6)) if record else _NO_EVENTS
            try:
                res = backend.step(seg_cols, lay_cols, unit_cols, scalars,
                                   self._constants, ev_rows)
            except Exception as e:  # noqa: BLE001 - any compile failure: See [Note: compiled step loop]
                if not compiled:
                    raise
                backend.fall_back(f"{type(e).__name__}: {e}")
                return self.simulate(plan, record=record)
            if len(modes) > 1:  # kept to choose from below (one mode: its locals stand)
                runs.append(_new(_Run, (mode, static, held, sharded_grads, ev_rows, res)))  # in _Run's field order
        grads_before = sharded_grads
        if runs:  # the faster that fits, else the smaller peak
            limit = opt.memory_budget_bytes if opt.memory_budget_bytes is not None else float("inf")
            fit = [r for r in runs if r.result.peak_bytes <= limit]
            last, every = runs
            times = {"last": last.result.bwd_end * (micro - 1) + last.result.end, "every": every.result.end * micro}
            run = min(fit, key=lambda r: times[r.mode]) if fit else min(runs, key=lambda r: r.result.peak_bytes)
            mode, static, held, grads_before = run.mode, run.static_bytes, run.held_bytes, run.sharded_grads_bytes
            ev_rows, res = run.events, run.result
        fwd_end, bwd_end, end, peak, peak_parts = res.fwd_end, res.bwd_end, res.end, res.peak_bytes, res.peak_parts
        comm_total = res.comm_s
        ev = [TimelineEvent(steploop.LANES[int(r[0])], steploop.KINDS[int(r[1])], units[int(r[2])].name, float(r[3]),
                            float(r[4]), int(r[5])) for r in ev_rows[:res.num_events]] if record else []
        # Optimizer: read/write the local shard of the trainable parameters and its states
        # (memory-bound), plus a fixed dispatch cost per trainable tensor (dominant for small
        # models; frozen parameters have no gradient and are skipped). Both calibrated by the
        # profiler's AdamW steps on fully_shard parameters, the per-tensor cost separately for
        # 2-D meshes (HSDP, no-shard): see profile/compute.py::measure_optimizer.
        cp = self.compute
        optim_s = (trainable / shard) * (2 + 2 * self._states) / (
            cp.optimizer_bandwidth_bytes_per_s or cp.memory_bandwidth_bytes_per_s)
        if self._stepping:
            per_tensor = (cp.optimizer_tensor_2d_s or cp.optimizer_tensor_s) if mesh.is_hsdp else cp.optimizer_tensor_s
            optim_s += self._num_tensors * per_tensor
        step = end + optim_s
        if record:
            ev.append(TimelineEvent("compute", "optim", "<all>", end, step, int(static)))

        if micro > 1:
            if mode == "every":  # every micro-batch: forward, backward and its reduce-scatters
                step += (micro - 1) * end
                comm_total *= micro
            else:
                # Earlier micro-batches: the same forward and backward without the
                # reduce-scatters (set_requires_gradient_sync(False)).
                step += (micro - 1) * bwd_end
        compute_s = per_set.compute_s + (sum(lay.times[0][ck].tolist()) if any_ck else 0)  # sum([]) is 0
        ck_oh = self._constants.checkpoint_overhead_s
        if ck_oh and any_ck:
            compute_s += ck_oh * int(lay.counts[KEEPS][ck].sum())
        compute_s += self.compute.loss_s * opt.batch_scale
        compute_s *= micro
        exposed = max(0.0, step - compute_s - optim_s)
        parts = (sharded_params, peak_parts[0] + grads_before if grads_before else peak_parts[0], optim, held)
        return CostEstimate(
            step_s=step,
            fwd_s=fwd_end,
            bwd_s=bwd_end - fwd_end,
            compute_s=compute_s,
            comm_s=comm_total,
            exposed_comm_s=exposed,
            peak_bytes=int(peak),
            peak_breakdown=tuple(zip(_PEAK_PARTS, map(int, parts + peak_parts[1:]))),
            units=cached.units,
            timeline=tuple(ev),
            notes=tuple(sorted(notes)),
            optim_s=optim_s,
            accumulation_sync=mode,
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
        >>> from wrapopt.hardware import analytical_compute, analytical_fabric
        >>> from wrapopt.search.baselines import baselines
        >>> model, x = zoo.build("gpt-tiny", "meta")
        >>> g = trace_model(model, x)
        >>> from wrapopt.spec import MeshSpec
        >>> mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
        >>> plan = baselines(g, mesh)["per-block"]
        >>> est = simulate(g, plan, analytical_fabric(world_size=8), analytical_compute())
        >>> est.step_s > 0
        True
    """

    validate_plan(graph, plan)
    return Simulator(graph, fabric, compute, options).simulate(plan, record=record)

