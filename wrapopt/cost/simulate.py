"""plan -> CostEstimate: one FSDP2 training step per rank, as the ``Simulator`` scores it.

``layout.py`` turns a plan's units into the segments the step walks ([Note:
segments]); ``step.py`` walks it on two lanes, *compute* and *comm*, and
holds the notes on how FSDP2 schedules a step and what memory holds
([Note: all-gather issue], [Note: backward schedule], [Note: memory],
[Note: overlap] and the rest); ``calls.py`` holds [Note: gradient sites],
[Note: progressive backward]. This file prepares the loop's inputs for a plan
(per-unit bytes and collective times, cached; the plan's per-unit choices)
and runs it once per accumulation mode; ``estimate.py`` holds the records it
caches and turns the chosen run into a ``CostEstimate`` (the optimizer step,
the earlier micro-batches, the peak's breakdown). Its
modelling decisions are the notes below; code cites them as
``# See [Note: ...]``.

[Note: reshard after forward] True frees the gathered parameters after the
unit's last forward segment and re-gathers them in backward; False keeps them
to backward (no second all-gather); an int N keeps a 1/N copy and re-gathers
over N ranks of one node. Plans keep the root unsharded (False), FSDP2's
default for the root.

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

How it stays fast is [Note: simulator speed] in backend.py.
"""

from __future__ import annotations

import math
import operator
from dataclasses import replace
from collections.abc import Callable
from typing import Any

import numpy as np

from wrapopt.cost.backend import Backend
from wrapopt.cost.calls import twin_times
from wrapopt.cost.collectives import CollectiveTimes
from wrapopt.cost.views import Views
from wrapopt.cost.fused import with_knobs
from wrapopt.cost.ep import ep_caveats, ep_problem, expert_counts
from wrapopt.cost.estimate import Choices, MeshCosts, Run, UnitSet, choose_run, make_estimate
from wrapopt.cost.dtypes import in_compute_dtype, optimizer_states_per_param, trainable_tensors
from wrapopt.cost.layout import Layouts
from wrapopt.cost.layout_types import NUMEL, SAVED, STORAGE, TRAINABLE_BYTES, TRAINABLE_NUMEL, Layout, unit_modules
from wrapopt.cost.pipeline import simulate_pipeline
from wrapopt.cost.state import copy_times, cpu_optimizer_s, host_bytes_per_rank, optimizer_s, static_bytes
from wrapopt.cost.step_inputs import (
    CK_FULL,
    CK_NONE,
    CK_SELECTIVE,
    PlanScalars,
    Segments,
    StepConstants,
    UnitLayout,
    UnitPlan,
)
from wrapopt.hardware.host import HostSpec, host_for
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.spec import (
    ROOT,
    SELECTIVE_OP,
    SYNC_MODES,
    CostEstimate,
    MeshSpec,
    ModelGraph,
    OptimizerKind,
    PlanSpec,
    SimOptions,
    UnitCosts,
    UnitSpec,
)
from wrapopt.spec.cp import cp_ranks_per_node
from wrapopt.units import ancestors, owner_by_ancestors, owner_index

# ep_problem, expert_counts: the experts the search splits (search imports cost.simulate, not cost.ep)
__all__ = ["Simulator", "ep_problem", "expert_counts"]

_RESHARD, _CHECKPOINT = operator.attrgetter("reshard_after_forward"), operator.attrgetter("checkpoint")
# A unit's checkpointing as the step loop reads it (UnitPlan.checkpoint): See [Note: memory] in step.py.
_CK_CODES = {False: CK_NONE, True: CK_FULL, SELECTIVE_OP: CK_SELECTIVE}

_NO_EVENTS = np.zeros((0, 6))  # the step loop's events when none are recorded: it writes none

# Builds a named tuple from a tuple of its fields in order, the cheapest way: the per-plan records
# below are built so (See [Note: step loop inputs] in step_inputs.py).
_new = tuple.__new__

# [Note: a host to price offload] A plan with CPU offload (``PlanSpec.offload``) is priced from the
# host link and host memory bandwidth the fabric's GPU preset states; the host memory the user
# states (``--host-memory``) only decides whether offload may be chosen (search/offload.py). So a
# simulator given no host (``wrapopt estimate`` of an offload plan file, any re-simulation built
# without one) takes the stated GPU's host, with the host memory marked as not stated, instead of
# failing after the search; a fabric that states no host (a measured one) is refused naming what
# to give (``host_for``).
def stated_host(fabric: FabricProfile, ranks_per_node: int) -> HostSpec:
    """The host ``fabric``'s GPU preset states, its memory not stated: See [Note: a host to price offload]."""
    host = host_for(fabric, host_memory_bytes=1, ranks_per_node=ranks_per_node)
    return replace(host, memory_bytes_per_node=0, source=f"{host.source}; host memory not stated (not checked)")


class Simulator(Views):
    """Scores plans for one model, fabric, compute profile and step options.

    Building one costs a pass over the module graph; ``simulate`` then runs in
    well under a millisecond for a 32-block model (layouts are cached per set
    of units), which keeps the search from ever waiting on the cost model.
    """

    def __init__(self, graph: ModelGraph, fabric: FabricProfile, compute: ComputeProfile,
                 options: SimOptions | None = None, *, backend: str | Backend | None = None,
                 host: HostSpec | None = None):
        """``backend``: 'compiled' (numba), 'python', a ``Backend``, or None for the default:
        compiled when numba is installed, unless ``WRAPOPT_JIT=0``. See [Note: compiled step loop].
        ``host``: what CPU offload runs on; plans with ``offload`` need it ([Note: CPU offload])."""
        self.options = options or SimOptions()
        self.host = host
        self.traced = graph  # as traced (before the compute dtype): the tensor-parallel views start from it
        self._tp_views: dict[tuple[Any, int], tuple[Simulator, frozenset[str]]] = {}
        self._cp_views: dict[tuple[int, int], tuple[Simulator, frozenset[str]]] = {}
        self._ep_views: dict[int, tuple[Simulator, frozenset[str]]] = {}
        self._plan_fix: Callable[[PlanSpec], PlanSpec] | None = None  # an ep view's experts units (cost/ep.py)
        self._ep_alone: tuple[int, frozenset[str]] | None = None  # an ep view's degree and experts modules
        self._stage_views: dict[tuple[Any, ...], dict[SimOptions, Simulator]] = {}  # [Note: pipeline stages]
        # See [Note: compute dtype] in dtypes.py: activations in the mixed-precision dtype.
        graph = in_compute_dtype(graph, self.options.activation_dtype_bytes, self.options.output_dtype_bytes)
        # See [Note: float8 costs] and [Note: compile costs] in fused.py.
        graph, compute, self._f8_share, self._knob_notes = with_knobs(
            graph, compute, self.options, act_bytes=float(self.options.activation_dtype_bytes or 2))
        compute = twin_times(graph, compute)  # See [Note: twin blocks] in calls.py
        self.graph, self.fabric, self.compute = graph, fabric, compute
        self._states = optimizer_states_per_param(graph, self.options.optimizer)  # optimizer state per element
        self._stepping = self.options.optimizer is not OptimizerKind.NONE
        # See [Note: accumulation sync]: the modes each plan is scored in.
        micro, sync = self.options.grad_accumulation, self.options.accumulation_sync
        self._modes = (None,) if micro == 1 else (sync,) if sync else SYNC_MODES
        self.backend = Backend.of(backend)
        self.layout = Layouts(graph, compute, self.options, backend=self.backend)
        self._elem = self.layout.elem  # storage bytes per element
        self.collectives = CollectiveTimes(fabric, self.backend)  # collective times by size
        self._sets: dict[tuple[tuple[str, ...], ...], UnitSet] = {}  # per set of units (and mesh)
        self._num_tensors = trainable_tensors(graph)  # the optimizer steps these only
        self._param_ancestors = tuple(ancestors(f.rsplit(".", 1)[0] if "." in f else ROOT) for f, _s, _d in
                                      graph.param_shapes)  # each parameter's module and its ancestors
        self._param_numels = tuple(math.prod(s) for _f, s, _d in graph.param_shapes)
        self._runs_ahead = compute.runs_ahead  # See [Note: all-gather issue]
        self._gather_elem = self.options.param_dtype_bytes or self._elem  # bytes per element all-gathered
        self._gather_elem += (1 - self._gather_elem) * self._f8_share  # the float8 all-gather: [Note: float8 costs]
        self._reduce_elem = self.options.reduce_dtype_bytes or self._gather_elem  # and reduce-scattered
        scale, out_b = self.options.batch_scale, graph.root.output_bytes * self.options.batch_scale
        self._constants = StepConstants(
            reduce_elem_bytes=float(self._reduce_elem),
            overlap_compute=1.0 + fabric.overlap_compute_slowdown,  # See [Note: overlap]
            overlap_comm=1.0 + fabric.overlap_comm_slowdown,
            unit_overhead_s=compute.unit_overhead_s,
            # per checkpointed block (a segment that starts a piece)
            checkpoint_overhead_s=compute.checkpoint_overhead_s,
            # See [Note: loss]: its time, the memory while it runs, the model's output, what it saves.
            loss_s=float(compute.loss_s * scale), loss_work_bytes=float(out_b + graph.loss_peak_bytes * scale),
            output_bytes=float(out_b), loss_saved_bytes=float(graph.loss_saved_bytes * scale),
            loss_grad_bytes=float(max(2 * out_b, graph.loss_grad_bytes * scale)),
            collective_copy=float(fabric.collective_copies),  # See [Note: collective copies]
            serial=0.0 if compute.runs_ahead else 1.0,  # See [Note: blocking collectives] in cost/step.py
            checkpoint_forward_s=min(compute.checkpoint_forward_s, compute.checkpoint_overhead_s))
        self._cols: dict[tuple[Any, bool], tuple[Segments, UnitLayout]] = {}  # per layout

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
                segs = Segments(np.array(segs.unit, dtype=np.int64),
                                *np.array(segs[1:], dtype=np.float64).reshape(11, -1))
                cols = UnitLayout(np.array(cols.forward, dtype=np.int64), np.array(cols.backward, dtype=np.int64),
                                  *np.array(cols[2:6], dtype=np.int64).reshape(4, -1),
                                  *np.array(cols[6:], dtype=np.float64).reshape(2, -1))
            else:
                segs = Segments._make(tuple(c.tolist()) for c in segs)
                cols = UnitLayout._make(tuple(c.tolist()) for c in cols)
            if len(self._cols) > 4096:
                self._cols.clear()
            hit = self._cols[key] = (segs, cols)
        return hit

    # -- the step: ``simulate`` and its phases, in the order it runs them --------------------

    def simulate(self, plan: PlanSpec, *, record: bool = False) -> CostEstimate:
        """Predict one training step of ``plan`` (see the notes at the top of this file)."""
        if self._plan_fix is not None:
            plan = self._plan_fix(plan)
        if plan.mesh.cp_size > 1:  # See [Note: context parallel costs] in cost/cp.py
            return self._simulate_cp(plan, record)
        if plan.mesh.ep_size > 1:  # See [Note: expert parallel costs] in cost/ep.py
            sub, notes = self.for_ep(plan.mesh.ep_size)  # a pipeline's stages are cut from it: [Note: ep in a pipeline]
            mesh = replace(plan.mesh, ep_size=1) if plan.pipeline is not None else plan.mesh.data_parallel()
            est = sub.simulate(replace(plan, mesh=mesh), record=record)
            return replace(est, notes=tuple(sorted(set(est.notes) | notes | ep_caveats(plan.mesh))))
        if plan.pipeline is not None:  # See [Note: pipeline stages] in pipeline.py
            return simulate_pipeline(self, plan, record=record)
        if plan.tp is not None:
            return self._simulate_tp(plan, record)
        units, mesh = plan.units, plan.mesh
        if self.options.offload and not plan.offload:  # See [Note: CPU offload] in state.py
            plan = replace(plan, offload=True)
        if plan.offload and self.host is None:  # See [Note: a host to price offload]
            self.host = stated_host(self.fabric, mesh.ranks_per_node)
        mods = tuple(map(unit_modules, units))
        per_set = self._unit_set(units, mods)
        per_mesh = self._mesh_costs(per_set, units, mesh, plan.offload)
        notes = set(per_mesh.notes)
        choices = self._reshard_choices(units, mesh, per_mesh, notes)
        run = self._run(plan, per_set, mods, per_mesh, choices, record)
        if run is None:  # compiled code failed: its backend runs Python from now on
            return self.simulate(plan, record=record)
        return self._estimate(plan, per_set, per_mesh, choices, run, notes, record)

    # -- context- and tensor-parallel dispatch

    def _simulate_cp(self, plan: PlanSpec, record: bool) -> CostEstimate:
        """The plan without its cp axis (FSDP over ``dp_shard x cp`` flattened, as the shard group
        already counts it) on one cp rank's share: See [Note: context parallel costs] in cp.py. A
        pipeline plan's stages are then cut from that share (its module times hold the ring's
        exchanges)."""
        mesh = plan.mesh
        per_node = cp_ranks_per_node(mesh.cp_size, mesh.ranks_per_node, mesh.tp_size)
        sub, cp_notes = self.for_cp(mesh.cp_size, per_node)
        est = sub.simulate(replace(plan, mesh=replace(mesh, cp_size=1)), record=record)
        return replace(est, notes=tuple(sorted(set(est.notes) | cp_notes))) if cp_notes else est

    def _simulate_tp(self, plan: PlanSpec, record: bool) -> CostEstimate:
        """FSDP on the data-parallel mesh of one tensor-parallel rank's model: See [Note:
        tensor parallel costs] in tp.py."""
        sub, tp_notes = self.for_tp(plan.tp, plan.mesh.tp_size)
        est = sub.simulate(replace(plan, mesh=plan.mesh.data_parallel(), tp=None), record=record)
        return replace(est, notes=tuple(sorted(set(est.notes) | tp_notes))) if tp_notes else est

    # -- cache lookups: what every plan of these units (and mesh) shares

    def _param_overhead(self, units: tuple[UnitSpec, ...]) -> np.ndarray:
        """Per unit: the profile's ``param_overhead_s`` x its parameter tensors (those of its modules no inner
        unit owns) and ``byte_overhead_s`` x the bytes it gathers. See [Note: per-parameter overhead] and
        [Note: per-byte overhead] in hardware/measure_fsdp.py."""
        out = np.zeros(len(units))
        per_param, per_byte = self.compute.param_overhead_s, self.compute.byte_overhead_s * self._gather_elem
        if per_param or per_byte:
            owner = owner_by_ancestors(owner_index(units), len(units))
            for anc, numel in zip(self._param_ancestors, self._param_numels):
                out[owner(anc)] += per_param + per_byte * numel
        return out

    def _unit_set(self, units: tuple[UnitSpec, ...], mods: tuple[tuple[str, ...], ...]) -> UnitSet:
        """Per set of units: its layout and sums. See [Note: simulator speed]."""
        per_set = self._sets.get(mods)
        if per_set is None:
            lay = self.layout.build(units, mods)  # not via the layout cache: this one is the cache
            if len(self._sets) > 4096:
                self._sets.clear()
            storage, trainable = lay.counts[STORAGE:TRAINABLE_BYTES + 1:TRAINABLE_BYTES - STORAGE].sum(1).tolist()
            fwd, bwd = lay.times[:2].tolist()
            per_set = self._sets[mods] = UnitSet(layout=lay, storage_bytes=storage, trainable_bytes=trainable,
                                                 compute_s=sum(fwd) + sum(bwd), per_mesh={},
                                                 param_overhead_s=self._param_overhead(units))
        return per_set

    def _mesh_costs(self, per_set: UnitSet, units: tuple[UnitSpec, ...], mesh: MeshSpec,
                    offload: bool = False) -> MeshCosts:
        """Per set of units and mesh (and offload): bytes and collective times of every unit,
        static memory and the optimizer step. See [Note: CPU offload] in state.py."""
        key = (mesh, True) if offload else mesh
        cached = per_set.per_mesh.get(key)
        if cached is None:
            lay, shard = per_set.layout, mesh.shard_size
            rpn_shard = min(shard, mesh.ranks_per_node)
            rpn_rep = 1 if shard >= mesh.ranks_per_node else max(1, mesh.ranks_per_node // shard)
            gathered = lay.counts[NUMEL] * self._gather_elem  # gathered bytes
            grads = lay.counts[TRAINABLE_NUMEL] * self._reduce_elem  # unsharded grad bytes
            caveats: set[str] = set()
            all_gather_s = self.collectives.times("all_gather", shard, rpn_shard, gathered, caveats)
            reduce_scatter_s = self.collectives.times("reduce_scatter", shard, rpn_shard, grads, caveats)
            all_reduce_s = self.collectives.times("all_reduce", mesh.world_size // shard, rpn_rep, grads / shard,
                                                  caveats)
            if self._ep_alone is not None:  # See [Note: expert parallel costs] in ep.py
                ep, experts = self._ep_alone
                alone = np.array([set(u.modules) <= experts for u in units])  # the experts' own units
                if shard <= ep:  # efsdp 1: no collective in the shard group
                    all_gather_s, reduce_scatter_s = (np.where(alone, 0.0, c) for c in (all_gather_s, reduce_scatter_s))
                if mesh.world_size > shard and alone.any():  # HSDP: a rank's expert shard is 1/efsdp of its experts
                    over = self.collectives.times("all_reduce", mesh.world_size // shard, rpn_rep,
                                                  grads / max(1, shard // ep), caveats)
                    all_reduce_s = np.where(alone, over, all_reduce_s)
            if offload:  # the host-device copies ride the collectives' streams
                h2d, d2h = copy_times(lay.counts[STORAGE], grads, shard, self.host)
                all_gather_s, reduce_scatter_s = all_gather_s + h2d, reduce_scatter_s + d2h
            columns = (gathered, grads, all_gather_s, reduce_scatter_s, all_reduce_s)
            if not all(c.dtype == np.float64 for c in columns):  # integers for an integer dtype size
                columns = tuple(np.array(columns, dtype=np.float64))
            unit_costs = UnitCosts(units, gathered, lay.times[0], lay.times[1], all_gather_s, reduce_scatter_s,
                                   lay.counts[SAVED])
            trainable, states = per_set.trainable_bytes, self._states
            sharded_params, optim = (0.0, 0.0) if offload else static_bytes(per_set.storage_bytes, trainable,
                                                                            states, shard)
            optim_s = (cpu_optimizer_s(trainable, states, shard, self.host) if offload else
                       optimizer_s(trainable, states, mesh, self.compute, num_tensors=self._num_tensors,
                                   stepping=self._stepping))
            cached = per_set.per_mesh[key] = MeshCosts(
                gathered_bytes=gathered, grad_bytes=grads, all_gather_s=all_gather_s, units=unit_costs,
                notes=frozenset(caveats), columns=columns, sharded_params_bytes=sharded_params,
                optimizer_bytes=optim, optim_s=optim_s)
        return cached

    # -- reshard and checkpoint choices

    def _reshard_choices(self, units: tuple[UnitSpec, ...], mesh: MeshSpec, per_mesh: MeshCosts,
                         notes: set[str]) -> Choices:
        """Per unit: backward re-gather time, bytes kept from forward to backward, checkpointing.
        See [Note: reshard after forward]."""
        gathered, all_gather_s, shard = per_mesh.gathered_bytes, per_mesh.all_gather_s, mesh.shard_size
        code = np.array([-1 if r is True else r for r in map(_RESHARD, units)], dtype=np.int64)  # True: -1, False: 0
        regather_s = np.where(code < 0, all_gather_s, 0.0)  # backward re-gather cost per unit
        keep = np.where(code == 0, gathered, 0.0)  # bytes kept between forward and backward
        if code.max() > 0:  # N: each rank keeps 1/N and re-gathers within N ranks
            for raf in np.unique(code[code > 0]).tolist():
                at = np.flatnonzero(code == raf)
                keep[at] = gathered[at] // raf if raf < shard else gathered[at]
                if raf > 1:
                    regather_s[at] = self.collectives.times("all_gather", raf, min(raf, mesh.ranks_per_node),
                                                            gathered[at], notes)
        cks = [_CK_CODES[c] for c in map(_CHECKPOINT, units)]
        return _new(Choices, (regather_s, keep, np.array(cks, dtype=np.int64), any(cks)))  # in Choices' field order

    # -- the step loop, once per accumulation mode, on the backend

    def _run(self, plan: PlanSpec, per_set: UnitSet, mods: tuple[tuple[str, ...], ...], per_mesh: MeshCosts,
             choices: Choices, record: bool) -> Run | None:
        """The step loop in each accumulation mode (See [Note: accumulation sync]) and the run
        the estimate reports; None when compiled code failed (See [Note: compiled step loop]
        and [Note: step loop inputs] in step_inputs.py)."""
        lay, shard, micro = per_set.layout, plan.mesh.shard_size, self.options.grad_accumulation
        trainable = per_set.trainable_bytes
        sharded_params, optim = per_mesh.sharded_params_bytes, per_mesh.optimizer_bytes
        backend = self.backend
        compiled = backend.kernels is not None
        seg_cols, lay_cols = self._columns(lay, mods, compiled)
        unit_cols = (*per_mesh.columns, choices.regather_s, choices.kept_bytes, choices.checkpoint,
                     per_set.param_overhead_s)  # UnitPlan's
        unit_cols = _new(UnitPlan, unit_cols if compiled else [c.tolist() for c in unit_cols])
        depth = max(plan.forward_prefetch, 1 if self._runs_ahead else 0)
        runs = []
        for mode in self._modes:
            if mode == "every":
                # Later micro-batches start with every sharded gradient in place (the loop
                # adds none: an infinite shard); no unsharded gradients are held.
                held, sharded_grads = 0, 0 if plan.offload else trainable / shard
                static, loop_shard = sharded_params + optim + sharded_grads, float("inf")
            else:
                held = sum(per_mesh.grad_bytes.tolist()) if micro > 1 else 0  # held across micro-batches (no-sync)
                # offload: sharded gradients land in host memory (the loop adds none on the GPU)
                static, loop_shard, sharded_grads = (sharded_params + optim + held,
                                                     float("inf") if plan.offload else float(shard), 0)
            scalars = _new(PlanScalars, (float(static), loop_shard, depth, record, bool(shard > 1)))  # in field order
            ev_rows = np.zeros((3 * len(plan.units) + 3 * lay.num_segments + 2, 6)) if record else _NO_EVENTS
            try:
                res = backend.step(seg_cols, lay_cols, unit_cols, scalars, self._constants, ev_rows)
            except Exception as e:  # noqa: BLE001 - any compile failure: See [Note: compiled step loop]
                if not compiled:
                    raise
                backend.fall_back(f"{type(e).__name__}: {e}")
                return None
            runs.append(_new(Run, (mode, static, held, sharded_grads, ev_rows, res)))  # in Run's field order
        return runs[0] if len(runs) == 1 else choose_run(runs, self.options)

    # -- event decoding, the optimizer, the result

    def host_bytes_per_rank(self, plan: PlanSpec) -> float:
        """Host memory one rank of ``plan`` fills under CPU offload: See [Note: CPU offload] in state.py."""
        return host_bytes_per_rank(self.graph.param_bytes, self.graph.trainable_bytes, self._states,
                                   plan.mesh.shard_size)

    def _estimate(self, plan: PlanSpec, per_set: UnitSet, per_mesh: MeshCosts, choices: Choices, run: Run,
                  notes: set[str], record: bool) -> CostEstimate:
        """The ``CostEstimate`` of ``run`` (``estimate.make_estimate``)."""
        return make_estimate(plan, per_set, per_mesh, choices, run, notes, record=record,
                             checkpoint_overhead_s=self._constants.checkpoint_overhead_s, loss_s=self.compute.loss_s,
                             options=self.options)
