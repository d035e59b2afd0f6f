"""Units -> layout: the per-unit sums and the segment sequence a plan's simulation walks.

Everything here depends only on which modules each unit owns, not on the
per-unit choices (resharding, checkpointing) or the mesh, so ``Layouts``
builds it once per set of units and caches it. This module's one concern is
that build, in its two forms (fragments in Python, ``kernels.layout_kernel``
compiled), which must agree. The step itself is walked in ``step.py``, for a
plan that ``simulate.py`` prepares.

[Note: segments] Forward compute is a sequence of *segments*: runs of
consecutive module calls owned by the same unit and inside the same block
(or top-level child), so memory is freed block by block even when one unit
owns many blocks (see [Note: unit ownership] in ``units.py``). The root unit
owns the embedding at the start and the head at the end, so it has segments
at both ends; a unit needs its parameters gathered before its first segment.

[Note: cut pieces] A piece that units cut into (a unit module strictly
inside a block) is split into segments by which unit owns each of its
modules. That split depends only on how the units group the modules inside
the piece (and which unit owns the piece around them), not on the other
pieces, so it is computed once per (run of the piece, grouping) and reused
by every plan that cuts the piece the same way. The search's sub-block plans
cut 32 blocks in a handful of ways each, so a new plan's layout is mostly
assembled from fragments already seen.

[Note: layout kernel] With a compiled backend (numba installed: See [Note:
compiled step loop] in ``backend.py``), ``build`` runs ``layout_kernel``
(``kernels.py``, its inputs ``LayoutTables``) instead: the same rules on
module ids, one pass over the module calls in forward order (each call's
owner is the innermost ancestor that is a unit; a segment ends where the
owner or the piece changes) and one over the parameter modules. It sums in
the same order as the fragment path, so both give the same layout exactly
(``tests/cost/test_step.py``); the fragment path stays for Python, where a loop
over every module call per plan would be slow.

``calls.py`` holds what the layout reads per module call: [Note: gradient
sites], [Note: progressive backward].
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable

import numpy as np

from wrapopt.cost.backend import Backend
from wrapopt.cost.calls import backward_working_set, module_calls, recomputed, region_depths
from wrapopt.cost.kernels import LayoutTables, layout_tables
from wrapopt.cost.layout_types import Layout, Segment, unit_modules
from wrapopt.cost.step_inputs import Segments, UnitLayout
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.spec import ModelGraph, SimOptions, UnitSpec
from wrapopt.units import ancestors, owner_by_ancestors, owner_index

__all__ = ["Layout", "Layouts", "Segment", "unit_modules"]


class Layouts:
    """Builds (and caches) the ``Layout`` of a set of units for one model, compute
    profile and step options. Building one costs a pass over the module graph.

    ``backend`` (by default ``Backend.default()``; a ``Simulator`` passes its own):
    compiled, ``build`` runs the layout kernel (See [Note: layout kernel])."""

    def __init__(self, graph: ModelGraph, compute: ComputeProfile, options: SimOptions, *,
                 backend: Backend | None = None):
        self.options = options
        self.backend = backend or Backend.default()
        scale = options.batch_scale
        blocks = set(graph.blocks)

        def piece(fqn: str) -> str:
            for a in ancestors(fqn):
                if a in blocks:
                    return a
            return fqn.split(".", 1)[0]

        self.elem = graph.param_bytes / max(1, graph.num_params)  # storage bytes per element
        self._reduce_elem = options.reduce_dtype_bytes or options.param_dtype_bytes or self.elem
        entries = module_calls(graph, compute, scale, piece)
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
        self._sums: dict[tuple[int, int, int], tuple[Any, ...]] = {}  # (run, start, end) -> a segment's sums
        self._reruns: dict[tuple[Any, ...], tuple[float, float]] = {}  # (run, start, end, depths) -> the reruns
        self._whole_rerun: dict[tuple[int, int], tuple[float, float]] = {}  # (run, its unit module's place) -> same
        self._runs = tuple((pc, anc, tuple(es)) for pc, anc, es in runs)
        self._runs = tuple((*run, self._seg_sums(r, 0, len(run[2]))) for r, run in enumerate(self._runs))
        piece_params: dict[str, list[int]] = {}
        for *_a, ne, nb, tn, tb, pc in self._param_modules:
            acc = piece_params.setdefault(pc, [0, 0, 0, 0])
            for k, v in enumerate((ne, nb, tn, tb)):
                acc[k] += v
        self._piece_params = tuple((pc, ancestors(pc), tuple(v)) for pc, v in piece_params.items())
        self._out_bytes = {m.fqn: m.output_bytes for m in graph.modules}
        # What checkpointing keeps of a piece: its output. See [Note: memory] in step.py.
        self._keep = {pc: int(self._out_bytes.get(pc, 0) * scale) for pc, *_r in self._runs}
        self._cache: dict[tuple[tuple[str, ...], ...], Layout] = {}
        self._tables: Any = None  # the layout kernel's arrays, built on first use
        self._inputs: dict[tuple[str, ...], int] = {}
        self._cut_params: dict[str, list[tuple[Any, ...]]] = {}  # piece -> its parameter modules
        for anc, ne, nb, tn, tb, pc in self._param_modules:
            self._cut_params.setdefault(pc, []).append((anc, ne, nb, tn, tb))

        # See [Note: cut pieces]: a run's shape is its entries' and its piece's parameter
        # modules' ancestors inside the piece, named relative to it; blocks alike share one.
        def inside(pc: str, anc: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(a[len(pc) + 1:] for a in anc[:anc.index(pc)])

        shape_ids: dict[Any, int] = {}
        self._shape_of = tuple(
            shape_ids.setdefault((tuple(inside(pc, e.anc) for e in es),
                                  tuple(inside(pc, p[0]) for p in self._cut_params.get(pc, ()))), len(shape_ids))
            for pc, _anc, es, _s in self._runs)
        self._shapes = tuple(shape_ids)
        self._splits: dict[Any, Any] = {}  # (shape, groups) -> segments as entry ranges, parameter owners
        self._psums: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, ...], ...]] = {}
        sigs: dict[Any, int] = {}  # pieces with the same parameter modules (relative names, sizes) share sums
        self._param_sig = {pc: sigs.setdefault(tuple((inside(pc, anc), *v) for anc, *v in ps), len(sigs))
                           for pc, ps in self._cut_params.items()}

    def __call__(self, units: tuple[UnitSpec, ...], key: tuple[tuple[str, ...], ...] | None = None) -> Layout:
        """The layout of ``units``; ``key`` is ``tuple(u.modules for u in units)`` if the caller has it."""
        if key is None:
            key = tuple(map(unit_modules, units))
        lay = self._cache.get(key)
        if lay is None:
            lay = self.build(units, key)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = lay
        return lay

    def build(self, units: tuple[UnitSpec, ...], mods: tuple[tuple[str, ...], ...] | None = None) -> Layout:
        """The layout of ``units`` (``mods``: their modules, if the caller has them), not cached:
        by the layout kernel where the backend is compiled, else from fragments."""
        kernels = self.backend.kernels
        if kernels is not None:  # See [Note: layout kernel]
            try:
                lay = self._build_compiled(kernels.layout, units, mods)
            except Exception as e:  # noqa: BLE001 - any compile failure: See [Note: compiled step loop]
                self.backend.fall_back(f"{type(e).__name__}: {e}")
                lay = None
            if lay is not None:
                return lay
        return self._build_fragments(units)

    # -- the fragment path: See [Note: cut pieces] ------------------------------------------

    def _build_fragments(self, units: tuple[UnitSpec, ...]) -> Layout:
        """``build`` as Python: whole pieces from their sums, cut pieces from fragments."""
        n = len(units)
        index = owner_index(units)
        owner = owner_by_ancestors(index, n)
        cut = self._cut_pieces(units)
        params = ([0] * n, [0] * n, [0] * n, [0] * n)  # elements, storage bytes, trainable elements and bytes
        owner_of = self._whole_piece_params(cut, owner, params)
        saved, work = [0] * n, [0] * n
        segments = self._segments(cut, owner, owner_of, params, saved, work, index)
        return self._assemble(units, segments, params, saved, work)

    def _cut_pieces(self, units: tuple[UnitSpec, ...]) -> dict[str, dict[int, list[str]]]:
        """Pieces a unit cuts into (a unit module strictly inside a piece), with the units
        that do, in unit order: they take the fragment path."""
        cut: dict[str, dict[int, list[str]]] = {}
        piece_of = self._piece_of
        for i, u in enumerate(units):
            for m in u.modules:
                pc = piece_of.get(m, m)
                if pc != m:
                    cut.setdefault(pc, {}).setdefault(i, []).append(m)
        return cut

    def _whole_piece_params(self, cut: dict[str, Any], owner: Callable[[tuple[str, ...]], int],
                            params: tuple[list[int], ...]) -> dict[str, int]:
        """Adds the parameters of every piece no unit cuts into to its owner's ``params``;
        returns the owner of each such piece."""
        numel, sbytes, tnumel, tbytes = params
        owner_of: dict[str, int] = {}  # piece -> the unit owning it whole (or around its cuts)
        for pc, anc, (ne, nb, tn, tb) in self._piece_params:
            if pc in cut:
                continue
            u = owner_of[pc] = owner(anc)
            numel[u] += ne
            sbytes[u] += nb
            tnumel[u] += tn
            tbytes[u] += tb
        return owner_of

    def _segments(self, cut: dict[str, dict[int, list[str]]], owner: Callable[[tuple[str, ...]], int],
                  owner_of: dict[str, int], params: tuple[list[int], ...], saved: list[int],
                  work: list[int], index: dict[str, int]) -> list[Segment]:
        """The segments in forward order: one per run of a whole piece, the fragments of a cut
        one (See [Note: cut pieces]). Adds each unit's saved activations and working set,
        and the cut pieces' parameters to ``params``. ``index``: unit module -> its unit."""
        numel, sbytes, tnumel, tbytes = params
        keep_of = self._keep
        segments: list[Segment] = []
        new = tuple.__new__
        seen: set[str] = set()
        for r, (pc, anc, _es, (f, b, sv, out, gn, bw, sk, so)) in enumerate(self._runs):
            u = owner_of.get(pc)
            if u is None:
                u = owner_of[pc] = owner(anc)
            inner = cut.get(pc)
            if inner is None:  # one owner for the whole run: one segment
                saved[u] += sv
                if out > work[u]:
                    work[u] = out
                kp = 0 if pc in seen else keep_of[pc]
                k = next((k for k, a in enumerate(anc) if a in index), -1)  # the unit module around the piece
                rs = self._whole_rerun.get((r, k))
                if rs is None:
                    depths = tuple(len(e.anc) - len(anc) + k if k >= 0 else -1 for e in _es)
                    rs = self._whole_rerun[(r, k)] = recomputed(_es, depths)
                segments.append(new(Segment, (u, f, b, sv, out, gn, bw, kp, rs[1], sk + kp, so, rs[0])))
                seen.add(pc)
                continue
            # See [Note: cut pieces]: the split depends only on how the units cut the piece.
            glob = tuple(inner) + (u,)  # local id -> unit; the last is the unit around the cuts
            cut_at = len(pc) + 1
            segs, powners = self._split(r, tuple(tuple(m[cut_at:] for m in ms) for ms in inner.values()))
            for k, (j, i0, i1) in enumerate(segs):
                vals = self._seg_sums(r, i0, i1)
                g = glob[j]
                saved[g] += vals[2]
                if vals[3] > work[g]:
                    work[g] = vals[3]
                kp = 0 if k or pc in seen else keep_of[pc]
                rf, sf = self._rerun(r, i0, i1, region_depths(_es[i0:i1], index))
                segments.append(new(Segment, (g, *vals[:6], kp, sf, vals[6] + kp, vals[7], rf)))
            if pc not in seen:
                for j, ne, nb, tn, tb in self._param_sums(pc, powners):
                    g = glob[j]
                    numel[g] += ne
                    sbytes[g] += nb
                    tnumel[g] += tn
                    tbytes[g] += tb
            seen.add(pc)
        for pc in cut.keys() - seen:  # cut pieces that never run still own parameters
            for anc, ne, nb, tn, tb in self._cut_params.get(pc, ()):
                g = owner(anc)
                numel[g] += ne
                sbytes[g] += nb
                tnumel[g] += tn
                tbytes[g] += tb
        return segments

    def _assemble(self, units: tuple[UnitSpec, ...], segments: list[Segment], params: tuple[list[int], ...],
                  saved: list[int], work: list[int]) -> Layout:
        """The ``Layout``: per-unit sums of the segments and the units' forward and backward order."""
        n = len(units)
        fwd, bwd, sel, sel_oh, rerun = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n  # its segments' sums
        order_d: dict[int, None] = {n - 1: None}
        last = [-1] * n
        nseg, seg_grads, nkeep = [0] * n, [0] * n, [0] * n
        for i, sgm in enumerate(segments):
            u = sgm[0]
            fwd[u] += sgm[1]
            bwd[u] += sgm[2]
            sel[u] += sgm[8]
            sel_oh[u] += sgm[10]
            rerun[u] += sgm[11]
            order_d[u] = None
            last[u] = i
            nseg[u] += 1
            seg_grads[u] += sgm[5]
            if sgm[7]:
                nkeep[u] += 1
        order = tuple(order_d)
        inputs = [self._input_bytes(u) for u in units]
        # Backward prefetch follows post-forward order reversed: the root (whose
        # forward ends last) comes first and prefetches the last block.
        border = tuple(sorted(order, key=lambda u: -last[u]))
        pos, bpos = [-1] * n, [-1] * n
        for k, u in enumerate(order):
            pos[u] = k
        for k, u in enumerate(border):
            bpos[u] = k
        numel, sbytes, tnumel, tbytes = params
        new = tuple.__new__
        counts = np.array((numel, sbytes, tnumel, tbytes, saved, work, inputs, nkeep), dtype=np.int64).reshape(8, n)
        return Layout(counts,
                      np.array((fwd, bwd, sel, sel_oh, rerun), dtype=np.float64).reshape(5, n),
                      new(Segments, zip(*segments)) if segments else new(Segments, ((),) * 12),
                      # forward, backward, last_fwd, fwd_pos, bwd_pos, num_segments, seg_grad_numel, trainable_bytes
                      new(UnitLayout, (order, border, tuple(last), tuple(pos), tuple(bpos), tuple(nseg),
                                       tuple(seg_grads), tuple(tbytes))))

    # -- the layout kernel: See [Note: layout kernel] ---------------------------------------

    def _kernel_tables(self) -> tuple[dict[str, int], LayoutTables]:
        """The module graph as the kernel reads it (``kernels.layout_tables``). Built on first use."""
        if self._tables is None:
            self._tables = layout_tables(self._runs, self._param_modules, self._out_bytes, self._keep,
                                         scale=float(self.options.batch_scale), reduce_elem=self._reduce_elem)
        return self._tables

    def _build_compiled(self, kernel: Any, units: tuple[UnitSpec, ...],
                        mods: tuple[tuple[str, ...], ...] | None = None) -> Layout | None:
        """``build`` by the compiled ``layout_kernel``; None if a unit names a module the graph lacks."""
        mid, tables = self._kernel_tables()
        if mods is None:
            mods = tuple(map(unit_modules, units))
        try:
            ids = np.fromiter(map(mid.__getitem__, chain.from_iterable(mods)), dtype=np.int64)
        except KeyError:
            return None
        listed = np.fromiter(map(len, mods), dtype=np.int64, count=len(mods))  # no intermediate list
        seg_u, seg_f, s, u_i, u_f, runs = kernel(ids, listed, *tables)  # the tables in the kernel's order
        # As Simulator._columns makes them; the rows of u_i and u_f: See layout_kernel.
        new = tuple.__new__  # the named tuples from their fields in order (faster than keywords)
        return Layout(u_i[:8], u_f[:5], new(Segments, (seg_u[:s], *seg_f[:, :s])),
                      # forward, backward, last_fwd, fwd_pos, bwd_pos, num_segments, seg_grad_numel, trainable_bytes
                      new(UnitLayout, (u_i[12, :runs], u_i[13, :runs], u_i[8], u_i[10], u_i[11], u_i[9], u_f[5],
                                       u_f[6])))

    def _split(self, r: int,
               groups: tuple[tuple[str, ...], ...]) -> tuple[tuple[tuple[int, int, int], ...], tuple[int, ...]]:
        """How units owning ``groups`` (modules relative to the piece, one tuple per
        unit: local ids 0..k-1; id k is the unit around them) split run ``r``: its
        segments as (local id, first entry, end), and the local owner of each of the
        piece's parameter modules. Cached per shape of piece (See [Note: cut pieces])."""
        key = (self._shape_of[r], groups)
        hit = self._splits.get(key)
        if hit is not None:
            return hit
        k = len(groups)
        local = {m: j for j, ms in enumerate(groups) for m in ms}

        def owner(rel_anc: tuple[str, ...]) -> int:
            for a in rel_anc:
                j = local.get(a)
                if j is not None:
                    return j
            return k

        entries, params = self._shapes[self._shape_of[r]]
        segs: list[list[int]] = []
        for i, rel_anc in enumerate(entries):
            j = owner(rel_anc)
            if segs and segs[-1][0] == j:
                segs[-1][2] = i + 1
            else:
                segs.append([j, i, i + 1])
        hit = (tuple((j, a, b) for j, a, b in segs), tuple(owner(rel_anc) for rel_anc in params))
        if len(self._splits) > 65536:
            self._splits.clear()
        self._splits[key] = hit
        return hit

    def _seg_sums(self, r: int, i0: int, i1: int) -> tuple[Any, ...]:
        """Entries ``i0:i1`` of run ``r`` as one segment: times, saved, working set,
        gradient elements, backward working set, and selective-op's kept bytes and per-pass
        overhead, summed in call order (the recomputes depend on the units: ``_rerun``). Cached."""
        key = (r, i0, i1)
        hit = self._sums.get(key)
        if hit is None:
            es = self._runs[r][2][i0:i1]
            f, b, sv, out, gn = es[0].fwd_s, es[0].bwd_s, es[0].saved, es[0].out, es[0].grad_numel
            sk, so = es[0].sel_kept, es[0].sel_ops_s
            for e in es[1:]:
                so += e.sel_ops_s
                sk += e.sel_kept
                f += e.fwd_s
                b += e.bwd_s
                sv += e.saved
                out = max(out, e.out)
                gn += e.grad_numel
            hit = self._sums[key] = (f, b, sv, out, gn, backward_working_set(es, self._reduce_elem), sk, so)
        return hit

    def _rerun(self, r: int, i0: int, i1: int, depths: tuple[int, ...]) -> tuple[float, float]:
        """What full and selective-op checkpointing recompute of entries ``i0:i1`` of run ``r``,
        whose checkpointed module is each one's ancestor at ``depths`` (-1: none), summed in call
        order as the layout kernel does. See [Note: early stop] in wrapopt/trace/record.py. Cached."""
        key = (r, i0, i1, depths)
        hit = self._reruns.get(key)
        if hit is None:
            if len(self._reruns) > 65536:
                self._reruns.clear()
            hit = self._reruns[key] = recomputed(self._runs[r][2][i0:i1], depths)
        return hit

    def _param_sums(self, pc: str, owners: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """(local id, elements, bytes, trainable elements, trainable bytes) of piece
        ``pc``'s parameters when its parameter modules have local ``owners``. Cached."""
        key = (self._param_sig[pc], owners)
        hit = self._psums.get(key)
        if hit is None:
            acc: dict[int, list[int]] = {}
            for j, (_anc, ne, nb, tn, tb) in zip(owners, self._cut_params.get(pc, ())):
                a = acc.setdefault(j, [0, 0, 0, 0])
                for i, v in enumerate((ne, nb, tn, tb)):
                    a[i] += v
            hit = self._psums[key] = tuple((j, *v) for j, v in acc.items())
        return hit

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


