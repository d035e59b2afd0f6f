"""plan -> CostEstimate: an event simulation of one FSDP2 training step, per rank.

Two lanes: *compute* (the default stream / the Python thread on CPU) and
*comm* (collectives). The simulation walks the forward in execution order and
the backward in reverse, placing each unit's all-gather, compute and
reduce-scatter where FSDP2 places them, and tracks memory at every event.
The notes below are the assumptions; code cites them as ``# See [Note: ...]``.

[Note: segments] Forward compute is a sequence of *segments*: runs of
consecutive module calls owned by the same unit and inside the same block
(or top-level child), so memory is freed block by block even when one unit
owns many blocks (see [Note: unit
ownership] in ``units.py``). The root unit owns the embedding at the start and
the head at the end, so it has segments at both ends; a unit needs its
parameters gathered before its first segment.

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

[Note: gradient sites] A parameter's unsharded gradient appears when backward
reaches the first module using it in backward order: for a tied parameter
(embedding and output head) that is the use that ran last in forward, so the
gradient lives through the whole backward until its unit's reduce-scatter.
Every other use (the other tied modules, a module called more than once)
accumulates into it: for that moment the new gradient and the sum are held
besides the old one.

[Note: progressive backward] Within a segment, backward visits its modules
in reverse: each module's gradients appear and, once its backward is done,
the activations it saved are freed. The segment's peak is the largest, over
its modules, of (gradients so far - activations freed so far + the gradient
arriving, of the module's output size, and the one leaving, of its input size
+ a gradient accumulation in flight), on top of the segment's saved activations and the
gradients from before.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from wrapopt.fabric import ComputeProfile, FabricProfile
from wrapopt.types import (
    ROOT,
    CostEstimate,
    MeshSpec,
    ModelGraph,
    PlanSpec,
    SimOptions,
    TimelineEvent,
    UnitCost,
    UnitSpec,
)
from wrapopt.units import ancestors, owner_index

__all__ = ["simulate", "Simulator"]


@dataclass(frozen=True, slots=True)
class _Entry:
    fqn: str
    anc: tuple[str, ...]
    fwd_s: float
    bwd_s: float
    saved: int
    out: int
    grad_numel: int  # trainable elements whose gradient appears at this module's backward
    piece: str  # the block (or top-level child) it belongs to: segments never span two
    acc_numel: int  # elements whose gradient is accumulated here into an existing one
    inp: int  # bytes of its floating inputs: the gradient its backward hands on


@dataclass(frozen=True, slots=True)
class _Segment:
    unit: int
    fwd_s: float
    bwd_s: float
    saved: int
    work: int  # working set: largest module output in the segment
    grad_numel: int  # gradients that appear during this segment's backward
    bwd_work: int  # most its backward holds beyond its saved activations and earlier gradients
    keep: int  # what checkpointing keeps of this block: its output (~ the next block's input)


@dataclass(frozen=True, slots=True)
class _Layout:
    """Everything about a set of units that does not depend on per-unit choices."""

    segments: tuple[_Segment, ...]
    order: tuple[int, ...]  # units in forward order of first segment (units that run)
    numel: tuple[int, ...]
    storage_bytes: tuple[int, ...]
    trainable_numel: tuple[int, ...]
    trainable_bytes: tuple[int, ...]
    saved: tuple[int, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    input_bytes: tuple[int, ...]  # what a checkpointed unit keeps (its input ~ its output)
    work: tuple[int, ...]
    last_fwd_segment: tuple[int, ...]
    pos: dict[int, int]  # unit -> its place in forward order
    border: tuple[int, ...]  # units in backward order (post-forward order reversed)
    bpos: dict[int, int]
    nseg: tuple[int, ...]  # segments per unit
    seg_grads: tuple[int, ...]  # gradient elements that appear during the unit's segments


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
        measured = {fqn: (f, b) for fqn, f, b in compute.module_times}
        scale = self.options.batch_scale
        blocks = set(graph.blocks)

        def piece(fqn: str) -> str:
            for a in ancestors(fqn):
                if a in blocks:
                    return a
            return fqn.split(".", 1)[0]

        self._elem = graph.param_bytes / max(1, graph.num_params)  # storage bytes per element
        grad_at, acc_at = self._gradient_sites(graph)
        entries = []
        for m in graph.call_order():
            if measured:
                f, b = measured.get(m.fqn, (0.0, 0.0))
            else:
                f = m.fwd_flops / compute.flops_per_s + compute.module_overhead_s * m.num_calls
                b = m.bwd_flops / compute.flops_per_s + compute.module_overhead_s * m.num_calls
            # The root's "output" is the model's, made by its last child: its own ops' working set is not it.
            out = 0 if m.fqn == ROOT else m.output_bytes
            entries.append(_Entry(m.fqn, ancestors(m.fqn), f * scale, b * scale, int(m.saved_bytes * scale),
                                  int(out * scale), grad_at.get(m.fqn, 0), piece(m.fqn), acc_at.get(m.fqn, 0),
                                  int((0 if m.fqn == ROOT else m.input_bytes) * scale)))
        self._entries = tuple(entries)
        self._param_modules = tuple(
            (ancestors(m.fqn), m.own_numel, m.own_bytes, m.own_trainable_numel, m.own_trainable_bytes, piece(m.fqn))
            for m in graph.modules
            if m.own_numel
        )
        # Fast path of _build_layout: a piece no unit cuts into is owned whole, so its
        # runs of consecutive entries and its parameters are summed once, here.
        self._piece_of = {m.fqn: piece(m.fqn) for m in graph.modules}
        runs: list[list[Any]] = []
        for e in entries:
            if runs and runs[-1][0] == e.piece:
                runs[-1][2].append(e)
            else:
                runs.append([e.piece, ancestors(e.piece), [e]])
        self._runs = tuple(
            (pc, anc, tuple(es), (sum(e.fwd_s for e in es), sum(e.bwd_s for e in es), sum(e.saved for e in es),
                                  max(e.out for e in es), sum(e.grad_numel for e in es), self._backward_working_set(es)))
            for pc, anc, es in runs
        )
        piece_params: dict[str, list[int]] = {}
        for *_a, ne, nb, tn, tb, pc in self._param_modules:
            acc = piece_params.setdefault(pc, [0, 0, 0, 0])
            for k, v in enumerate((ne, nb, tn, tb)):
                acc[k] += v
        self._piece_params = tuple((pc, ancestors(pc), tuple(v)) for pc, v in piece_params.items())
        self._out_bytes = {m.fqn: m.output_bytes for m in graph.modules}
        self._layouts: dict[tuple[tuple[str, ...], ...], _Layout] = {}
        self._colls: dict[tuple[str, int, int, float], tuple[float, str | None]] = {}  # collective times by size
        self._unit_colls: dict[tuple[Any, MeshSpec], tuple[Any, ...]] = {}
        self._num_tensors = len(graph.param_shapes)

    @staticmethod
    def _gradient_sites(graph: ModelGraph) -> tuple[dict[str, int], dict[str, int]]:
        """Where gradients appear in backward: See [Note: gradient sites].

        Returns (module -> trainable elements whose gradient appears at its backward,
        module -> elements whose gradient is accumulated there into an existing one)."""
        grad_at = {m.fqn: m.own_trainable_numel for m in graph.modules if m.own_trainable_numel}
        acc_at: dict[str, int] = {}
        order = {m.fqn: m.order for m in graph.modules}
        numel = {fqn: math.prod(shape) for fqn, shape, _dt in graph.param_shapes}
        for group in graph.tied_groups:
            owners = [fqn.rsplit(".", 1)[0] if "." in fqn else ROOT for fqn in group]
            n = numel.get(group[0], 0)
            ran = [o for o in dict.fromkeys(owners) if order.get(o, -1) >= 0]
            if not ran or grad_at.get(owners[0], 0) < n:
                continue  # frozen, or never used
            last = max(ran, key=lambda o: order[o])  # runs last in forward, first in backward
            grad_at[owners[0]] -= n
            grad_at[last] = grad_at.get(last, 0) + n
            for o in ran:
                if o != last:
                    acc_at[o] = acc_at.get(o, 0) + n
        for m in graph.modules:
            if m.num_calls > 1 and m.own_trainable_numel:
                acc_at[m.fqn] = acc_at.get(m.fqn, 0) + m.own_trainable_numel
        return grad_at, acc_at

    # -- layout ---------------------------------------------------------------------------

    def layout(self, units: tuple[UnitSpec, ...]) -> _Layout:
        key = tuple(u.modules for u in units)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._build_layout(units)
            if len(self._layouts) > 4096:
                self._layouts.clear()
            self._layouts[key] = lay
        return lay

    def _build_layout(self, units: tuple[UnitSpec, ...]) -> _Layout:
        n = len(units)
        index = owner_index(units)

        def owner(anc: tuple[str, ...]) -> int:
            for a in anc:
                i = index.get(a)
                if i is not None:
                    return i
            return n - 1

        # Pieces a unit cuts into (a unit module strictly inside a piece) take the slow path.
        cut = {self._piece_of.get(m, m) for u in units for m in u.modules if self._piece_of.get(m, m) != m}
        numel, sbytes, tnumel, tbytes = [0] * n, [0] * n, [0] * n, [0] * n
        for pc, anc, (ne, nb, tn, tb) in self._piece_params:
            if pc in cut:
                continue
            u = owner(anc)
            numel[u] += ne
            sbytes[u] += nb
            tnumel[u] += tn
            tbytes[u] += tb
        if cut:
            for anc, ne, nb, tn, tb, pc in self._param_modules:
                if pc in cut:
                    u = owner(anc)
                    numel[u] += ne
                    sbytes[u] += nb
                    tnumel[u] += tn
                    tbytes[u] += tb
        segs: list[list[Any]] = []
        saved, fwd, bwd, work = [0] * n, [0.0] * n, [0.0] * n, [0] * n
        for pc, anc, es, (f, b, sv, out, gn, bw) in self._runs:
            if pc not in cut:  # one owner for the whole run: one segment
                u = owner(anc)
                saved[u] += sv
                fwd[u] += f
                bwd[u] += b
                work[u] = max(work[u], out)
                segs.append([u, f, b, sv, out, gn, bw, pc])
                continue
            for e in es:
                u = owner(e.anc)
                saved[u] += e.saved
                fwd[u] += e.fwd_s
                bwd[u] += e.bwd_s
                work[u] = max(work[u], e.out)
                if segs and segs[-1][0] == u and segs[-1][7] == e.piece and isinstance(segs[-1][6], list):
                    sg = segs[-1]
                    sg[1] += e.fwd_s
                    sg[2] += e.bwd_s
                    sg[3] += e.saved
                    sg[4] = max(sg[4], e.out)
                    sg[5] += e.grad_numel
                    sg[6].append(e)
                else:
                    segs.append([u, e.fwd_s, e.bwd_s, e.saved, e.out, e.grad_numel, [e], e.piece])
        seen_pieces: set[str] = set()
        segments = []
        for s in segs:
            piece = s[7]
            first = piece not in seen_pieces
            seen_pieces.add(piece)
            keep = int(self._out_bytes.get(piece, 0) * self.options.batch_scale) if first else 0
            bw = s[6] if isinstance(s[6], int) else self._backward_working_set(s[6])
            segments.append(_Segment(*s[:6], bw, keep))
        segments = tuple(segments)
        order = tuple(dict.fromkeys([n - 1] + [s.unit for s in segments]))
        last = [-1] * n
        for i, s in enumerate(segments):
            last[s.unit] = i
        ob = self._out_bytes
        inputs = [max((ob.get(m, 0) for m in u.modules), default=0) if not u.is_root else 0 for u in units]
        # Backward prefetch follows post-forward order reversed: the root (whose
        # forward ends last) comes first and prefetches the last block.
        border = tuple(sorted(order, key=lambda u: -last[u]))
        nseg, seg_grads = [0] * n, [0] * n
        for sg in segments:
            nseg[sg.unit] += 1
            seg_grads[sg.unit] += sg.grad_numel
        return _Layout(segments, order, tuple(numel), tuple(sbytes), tuple(tnumel), tuple(tbytes), tuple(saved),
                       tuple(fwd), tuple(bwd), tuple(int(x * self.options.batch_scale) for x in inputs), tuple(work), tuple(last),
                       {u: k for k, u in enumerate(order)}, border, {u: k for k, u in enumerate(border)},
                       tuple(nseg), tuple(seg_grads))

    def _backward_working_set(self, entries: list[_Entry] | tuple[_Entry, ...]) -> int:
        """Most bytes a segment's backward holds beyond its saved activations and the
        gradients before it. See [Note: progressive backward]."""
        opt = self.options
        reduce_elem = opt.reduce_dtype_bytes or opt.param_dtype_bytes or self._elem
        freed = grads = 0.0
        best = 0.0
        for e in reversed(entries):
            grads += e.grad_numel * reduce_elem
            # The gradient arriving (output-sized) and the one leaving (input-sized; the
            # output's size again where the tracer did not see the inputs).
            leaving = e.inp if e.inp else e.out
            best = max(best, grads - freed + e.out + leaving + 2 * e.acc_numel * reduce_elem)
            freed += e.saved
        return int(best)

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
        lay = self.layout(units)
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

        ckey = (tuple(u.modules for u in units), mesh)
        cached = self._unit_colls.get(ckey)
        if cached is None:  # per set of units and mesh: bytes and collective times of every unit
            cn: set[str] = set()
            P = [lay.numel[i] * gather_elem for i in range(n)]  # gathered bytes
            G = [lay.trainable_numel[i] * reduce_elem for i in range(n)]  # unsharded grad bytes
            ag = [self._coll("all_gather", shard, rpn_shard, P[i], cn) for i in range(n)]
            rs = [self._coll("reduce_scatter", shard, rpn_shard, G[i], cn) for i in range(n)]
            ar = [self._coll("all_reduce", mesh.world_size // shard, rpn_rep, G[i] / shard, cn) for i in range(n)]
            if len(self._unit_colls) > 4096:
                self._unit_colls.clear()
            ucosts = tuple(UnitCost(u.name, int(P[i]), lay.fwd_s[i], lay.bwd_s[i], ag[i], rs[i], lay.saved[i])
                           for i, u in enumerate(units))
            cached = self._unit_colls[ckey] = (P, G, ag, rs, ar, frozenset(cn), ucosts)
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
            if record and d > 0:
                ev.append(TimelineEvent("comm", "all_gather", units[u].name, start, c, int(note_mem(0))))
            note_mem(0)
            return c

        def run(dur: float, kind: str, u: int, work: float) -> None:
            nonlocal t
            start = t
            busy = max(0.0, min(c, start + dur) - start)  # comm overlapping this compute
            t = start + dur + busy * (ovl_c - 1.0)
            m = note_mem(work)
            if record and t > start:
                ev.append(TimelineEvent("compute", kind, units[u].name, start, t, int(m)))

        ag_end[order[0]] = issue_ag(order[0], 0.0)
        issued[order[0]] = True
        seen_first = [False] * n
        for si, s in enumerate(lay.segments):
            u = s.unit
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
            ck = units[u].checkpoint
            run(s.fwd_s, "fwd", u, s.work)
            # Checkpointing wraps each of the unit's modules: each keeps only its boundary tensor.
            acts += s.keep if ck else s.saved
            if si == lay.last_fwd_segment[u]:
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

        for s in reversed(lay.segments):
            u = s.unit
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
            if units[u].checkpoint:  # recompute this block's forward, re-saving its activations
                acts += s.saved - s.keep
                run(s.fwd_s + (ck_oh if s.keep else 0.0), "recompute", u, s.work)
            run(s.bwd_s, "bwd", u, s.bwd_work)  # See [Note: progressive backward]
            grads_pending += s.grad_numel * reduce_elem
            acts -= s.saved
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

