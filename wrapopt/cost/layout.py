"""Units -> layout: the per-unit sums and the segment sequence a plan's simulation walks.

Everything here depends only on which modules each unit owns, not on the
per-unit choices (resharding, checkpointing) or the mesh, so ``Layouts``
builds it once per set of units and caches it. The step itself is simulated
in ``simulate.py``.

[Note: segments] Forward compute is a sequence of *segments*: runs of
consecutive module calls owned by the same unit and inside the same block
(or top-level child), so memory is freed block by block even when one unit
owns many blocks (see [Note: unit ownership] in ``units.py``). The root unit
owns the embedding at the start and the head at the end, so it has segments
at both ends; a unit needs its parameters gathered before its first segment.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from wrapopt.fabric import ComputeProfile
from wrapopt.types import ROOT, ModelGraph, SimOptions, UnitSpec
from wrapopt.units import ancestors, owner_index

__all__ = ["Layout", "Layouts", "Segment"]


class _Entry(NamedTuple):
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


class Segment(NamedTuple):
    """A plain tuple, so the simulation's hot loop can unpack it."""

    unit: int
    fwd_s: float
    bwd_s: float
    saved: int
    work: int  # working set: largest module output in the segment
    grad_numel: int  # gradients that appear during this segment's backward
    bwd_work: int  # most its backward holds beyond its saved activations and earlier gradients
    keep: int  # what checkpointing keeps of this block: its output (~ the next block's input)


@dataclass(frozen=True, slots=True)
class Layout:
    """Everything about a set of units that does not depend on per-unit choices."""

    segments: tuple[Segment, ...]
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


class Layouts:
    """Builds (and caches) the ``Layout`` of a set of units for one model, compute
    profile and step options. Building one costs a pass over the module graph."""

    def __init__(self, graph: ModelGraph, compute: ComputeProfile, options: SimOptions):
        self.options = options
        measured = {fqn: (f, b) for fqn, f, b in compute.module_times}
        scale = options.batch_scale
        blocks = set(graph.blocks)

        def piece(fqn: str) -> str:
            for a in ancestors(fqn):
                if a in blocks:
                    return a
            return fqn.split(".", 1)[0]

        self.elem = graph.param_bytes / max(1, graph.num_params)  # storage bytes per element
        grad_at, acc_at = gradient_sites(graph)
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
        self._param_modules = tuple(
            (ancestors(m.fqn), m.own_numel, m.own_bytes, m.own_trainable_numel, m.own_trainable_bytes, piece(m.fqn))
            for m in graph.modules
            if m.own_numel
        )
        # Fast path of build(): a piece no unit cuts into is owned whole, so its
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
        # What checkpointing keeps of a piece: its output. See [Note: memory] in simulate.py.
        self._keep = {pc: int(self._out_bytes.get(pc, 0) * scale) for pc, *_r in self._runs}
        self._cache: dict[tuple[tuple[str, ...], ...], Layout] = {}
        self._inputs: dict[tuple[str, ...], int] = {}
        self._bw: dict[tuple[int, int, int], int] = {}  # (run, start, end) -> its backward working set

    def __call__(self, units: tuple[UnitSpec, ...], key: tuple[tuple[str, ...], ...] | None = None) -> Layout:
        """The layout of ``units``; ``key`` is ``tuple(u.modules for u in units)`` if the caller has it."""
        if key is None:
            key = tuple(u.modules for u in units)
        lay = self._cache.get(key)
        if lay is None:
            lay = self.build(units)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = lay
        return lay

    def build(self, units: tuple[UnitSpec, ...]) -> Layout:
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
        owner_of: dict[str, int] = {}  # piece -> its owner, for pieces no unit cuts into
        for pc, anc, (ne, nb, tn, tb) in self._piece_params:
            if pc in cut:
                continue
            u = owner_of[pc] = owner(anc)
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
        saved, fwd, bwd, work = [0] * n, [0.0] * n, [0.0] * n, [0] * n
        keep_of = self._keep
        segments: list[Segment] = []
        seen: set[str] = set()
        for r, (pc, anc, es, (f, b, sv, out, gn, bw)) in enumerate(self._runs):
            if pc not in cut:  # one owner for the whole run: one segment
                u = owner_of.get(pc)
                if u is None:
                    u = owner_of[pc] = owner(anc)
                saved[u] += sv
                fwd[u] += f
                bwd[u] += b
                if out > work[u]:
                    work[u] = out
                segments.append(Segment(u, f, b, sv, out, gn, bw, 0 if pc in seen else keep_of[pc]))
                seen.add(pc)
                continue
            segs: list[list[Any]] = []  # runs of one owner within this piece
            for k, e in enumerate(es):
                u = owner(e.anc)
                saved[u] += e.saved
                fwd[u] += e.fwd_s
                bwd[u] += e.bwd_s
                work[u] = max(work[u], e.out)
                if segs and segs[-1][0] == u:
                    sg = segs[-1]
                    sg[1] += e.fwd_s
                    sg[2] += e.bwd_s
                    sg[3] += e.saved
                    sg[4] = max(sg[4], e.out)
                    sg[5] += e.grad_numel
                    sg[7] = k + 1
                else:
                    segs.append([u, e.fwd_s, e.bwd_s, e.saved, e.out, e.grad_numel, k, k + 1])
            for s in segs:
                bkey = (r, s[6], s[7])  # the segment is es[start:end]
                bw = self._bw.get(bkey)
                if bw is None:
                    bw = self._bw[bkey] = self._backward_working_set(es[s[6]:s[7]])
                segments.append(Segment(*s[:6], bw, 0 if pc in seen else keep_of[pc]))
                seen.add(pc)
        order = tuple(dict.fromkeys([n - 1] + [s.unit for s in segments]))
        last = [-1] * n
        nseg, seg_grads = [0] * n, [0] * n
        for i, s in enumerate(segments):
            last[s.unit] = i
            nseg[s.unit] += 1
            seg_grads[s.unit] += s.grad_numel
        inputs = [self._input_bytes(u) for u in units]
        # Backward prefetch follows post-forward order reversed: the root (whose
        # forward ends last) comes first and prefetches the last block.
        border = tuple(sorted(order, key=lambda u: -last[u]))
        return Layout(tuple(segments), order, tuple(numel), tuple(sbytes), tuple(tnumel), tuple(tbytes), tuple(saved),
                      tuple(fwd), tuple(bwd), tuple(inputs), tuple(work), tuple(last),
                      {u: k for k, u in enumerate(order)}, border, {u: k for k, u in enumerate(border)},
                      tuple(nseg), tuple(seg_grads))

    def _input_bytes(self, u: UnitSpec) -> int:
        """What a checkpointed unit keeps: its input, taken as its largest module's output."""
        hit = self._inputs.get(u.modules)
        if hit is None:
            ob = self._out_bytes
            hit = 0 if u.is_root else int(max((ob.get(m, 0) for m in u.modules), default=0) * self.options.batch_scale)
            if len(self._inputs) > 65536:
                self._inputs.clear()
            self._inputs[u.modules] = hit
        return hit

    def _backward_working_set(self, entries: list[_Entry] | tuple[_Entry, ...]) -> int:
        """Most bytes a segment's backward holds beyond its saved activations and the
        gradients before it. See [Note: progressive backward]."""
        opt = self.options
        reduce_elem = opt.reduce_dtype_bytes or opt.param_dtype_bytes or self.elem
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


def gradient_sites(graph: ModelGraph) -> tuple[dict[str, int], dict[str, int]]:
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
