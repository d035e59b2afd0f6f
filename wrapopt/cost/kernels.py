"""The array functions numba compiles beside the step loop: ``layout_kernel`` and the
size tables' ``lookup`` and ``merge``.

``layout_kernel`` is ``Layouts.build`` on module ids: See [Note: layout kernel]
in ``layout.py``, which prepares its arrays (``Layouts._kernel_tables``) and
turns its result into a ``Layout``. ``lookup`` and ``merge`` keep the sorted
tables of collective times by message size (``collectives.py``).
``backend.compile_kernels()`` compiles all three; as Python they run
unchanged. No modelling decision here: these apply the rules of ``layout.py``
and ``calls.py`` on arrays.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from wrapopt.spec import ROOT

__all__ = ["LAYOUT_HELPERS", "PER_SEGMENT_HELPERS", "LayoutTables", "layout_tables", "layout_kernel", "lookup", "merge"]


class LayoutTables(NamedTuple):
    """The module graph as ``layout_kernel`` reads it, after the units' ``ids`` and
    ``listed`` (its arguments, in this order): See its docstring."""

    e_anc: np.ndarray  # per module call, in forward order: ancestor ids, innermost first, -1 padded
    e_skip: np.ndarray  # the same shape: the share of its forward a checkpoint around that ancestor does not rerun
    e_piece: np.ndarray  # its piece
    # (forward, backward, selective-op's recompute, selective-op's per-pass overhead, per-call overhead) seconds
    e_time: np.ndarray
    e_int: np.ndarray  # (saved, output, gradient elements, accumulated elements, input bytes, selective-op's kept)
    keep_of: np.ndarray  # per piece: what checkpointing keeps
    p_anc: np.ndarray  # per parameter module: ancestor ids
    p_vals: np.ndarray  # (elements, bytes, trainable elements, trainable bytes)
    m_out: np.ndarray  # per module id: output bytes
    root_id: int  # -2: no root module
    scale: float  # the batch scale
    reduce_elem: float  # bytes per gradient element in the reduce-scatter

def layout_tables(runs: Any, param_modules: Any, out_bytes: dict[str, float], keep: dict[str, Any], *,
                  scale: float, reduce_elem: Any) -> tuple[dict[str, int], LayoutTables]:
    """The module graph as ``layout_kernel`` reads it: module ids, and arrays of the module calls
    (``runs``: per piece, its entries in forward order) and of the parameter modules."""
    mid: dict[str, int] = {}
    for _pc, _anc, es, _s in runs:
        for e in es:
            for a in e.anc:
                mid.setdefault(a, len(mid))
    for anc, *_v in param_modules:
        for a in anc:
            mid.setdefault(a, len(mid))
    for fqn in out_bytes:
        mid.setdefault(fqn, len(mid))
    entries = [e for _pc, _anc, es, _s in runs for e in es]
    pieces: dict[str, int] = {}
    e_piece = [pieces.setdefault(pc, len(pieces)) for pc, _anc, es, _s in runs for _e in es]
    depth = max([len(e.anc) for e in entries] + [len(p[0]) for p in param_modules] + [1])

    def anc_ids(ancs: list[tuple[str, ...]]) -> np.ndarray:
        out = np.full((len(ancs), depth), -1, dtype=np.int64)
        for i, anc in enumerate(ancs):
            out[i, :len(anc)] = [mid[a] for a in anc]
        return out

    e_skip = np.zeros((len(entries), depth), dtype=np.float64)
    for i, e in enumerate(entries):
        e_skip[i, :len(e.skip)] = e.skip

    m_out = np.zeros(len(mid), dtype=np.float64)
    for fqn, b in out_bytes.items():
        m_out[mid[fqn]] = b
    return mid, LayoutTables(
        e_anc=anc_ids([e.anc for e in entries]),
        e_skip=e_skip,
        e_piece=np.array(e_piece, dtype=np.int64).reshape(-1),
        e_time=np.array([[e.fwd_s for e in entries], [e.bwd_s for e in entries], [e.sel_fwd_s for e in entries],
                         [e.sel_ops_s for e in entries], [e.call_s for e in entries]],
                        dtype=np.float64).reshape(5, -1),
        e_int=np.array([[e.saved, e.out, e.grad_numel, e.acc_numel, e.inp, e.sel_kept] for e in entries],
                       dtype=np.int64).reshape(-1, 6).T.copy(),
        keep_of=np.array([keep[pc] for pc in pieces], dtype=np.int64),
        p_anc=anc_ids([p[0] for p in param_modules]),
        p_vals=np.array([p[1:5] for p in param_modules], dtype=np.int64).reshape(-1, 4).T.copy(),
        m_out=m_out, root_id=mid[ROOT] if ROOT in mid else -2, scale=scale, reduce_elem=reduce_elem,
    )



def layout_kernel(ids, listed, e_anc, e_skip, e_piece, e_time, e_int, keep_of, p_anc, p_vals, m_out,  # noqa: ANN001
                  root_id, scale, reduce_elem):
    """``Layouts.build`` on module ids, for numba: See [Note: layout kernel] in layout.py.

    Units list modules ``ids``, ``listed[u]`` of them for unit ``u``. Module calls in forward order:
    ancestor ids ``e_anc`` (innermost first, -1 padded) and the share of its forward a checkpoint around
    each does not rerun ``e_skip``, piece ``e_piece``, times ``e_time`` (forward, backward, selective
    recompute and per-pass overhead, per-call overhead) and ``e_int`` (saved, output, gradient elements,
    accumulated elements, input bytes, selective kept); ``keep_of`` per piece. Parameter modules:
    ancestors ``p_anc`` and ``p_vals`` (elements, bytes, trainable elements and bytes).
    ``m_out``: each module's output bytes. Returns the segments (their units and
    the other 11 columns of ``Segment``; the first ``s`` are used), ``s``, per-unit
    integer rows (``Layout.counts``, then the step loop's) and float rows (times,
    then the step loop's), and how many units run."""
    n = listed.shape[0]
    unit_of, widest = _unit_of_modules(ids, listed, m_out)
    own, rerun, sel_rerun = _call_owners(e_anc, e_skip, e_time, unit_of, n)
    seg_u, seg_f, s, u_i, u_f, runs = _segments(e_piece, e_time, e_int, keep_of, own, rerun, sel_rerun, n,
                                                reduce_elem)
    _add_parameters(p_anc, p_vals, unit_of, u_i)
    k = 0
    for u in range(n):
        u_f[6, u] = u_i[3, u]
        u_i[6, u] = int(widest[u] * scale)
        if listed[u] == 1 and ids[k] == root_id:  # UnitSpec.is_root keeps nothing
            u_i[6, u] = 0
        k += listed[u]
    _backward_order(seg_u, s, u_i)
    return seg_u, seg_f, s, u_i, u_f, runs


def _unit_of_modules(ids, listed, m_out):  # noqa: ANN001, ANN202
    """Per module id, the unit that lists it (-1: none), and per unit its largest module output."""
    n = listed.shape[0]
    unit_of = np.full(m_out.shape[0], -1, np.int64)
    widest = np.zeros(n, np.float64)
    k = 0
    for u in range(n):
        for _ in range(listed[u]):
            unit_of[ids[k]] = u  # a module listed twice: the last unit wins, as owner_index
            if m_out[ids[k]] > widest[u]:
                widest[u] = m_out[ids[k]]
            k += 1
    return unit_of, widest


def _call_owners(e_anc, e_skip, e_time, unit_of, n):  # noqa: ANN001, ANN202
    """Per module call: its unit (the innermost ancestor a unit lists; else the root, ``n - 1``) and
    what a checkpoint around that unit's module recomputes of it, full and selective-op: its kernels
    less those after the early stop, and its per-call overhead (See [Note: early stop] in
    wrapopt/trace/record.py)."""
    ne, depth = e_anc.shape
    own = np.empty(ne, np.int64)
    rerun = np.empty(ne, np.float64)
    sel_rerun = np.empty(ne, np.float64)
    for i in range(ne):
        own[i] = n - 1
        rerun[i] = e_time[0, i]
        sel_rerun[i] = e_time[2, i]
        for d in range(depth):
            a = e_anc[i, d]
            if a < 0:
                break
            if unit_of[a] >= 0:
                own[i] = unit_of[a]
                rerun[i] = e_time[0, i] - e_skip[i, d] * (e_time[0, i] - e_time[4, i])
                sel_rerun[i] = e_time[2, i] - e_skip[i, d] * (e_time[2, i] - e_time[4, i])
                break
    return own, rerun, sel_rerun


def _backward_work(e_int, i, j, reduce_elem):  # noqa: ANN001, ANN202
    """The most calls ``i..j-1`` hold in backward beyond their saved activations and earlier
    gradients: See [Note: progressive backward] in calls.py, as ``backward_working_set``."""
    freed = grads = best = 0.0
    for k in range(j - 1, i - 1, -1):
        grads += e_int[2, k] * reduce_elem
        leaving = e_int[4, k] if e_int[4, k] else e_int[1, k]
        x = grads - freed + e_int[1, k] + leaving + 2 * e_int[3, k] * reduce_elem
        if x > best:
            best = x
        freed += e_int[0, k]
    return best


def _segments(e_piece, e_time, e_int, keep_of, own, rerun, sel_rerun, n, reduce_elem):  # noqa: ANN001, ANN202, PLR0913
    """The segments (runs of calls of one piece and one unit) and the per-unit sums over them."""
    ne = own.shape[0]
    seg_u = np.empty(ne, np.int64)
    seg_f = np.empty((11, ne), np.float64)  # the other columns of Segment
    # Layout.counts' rows (numel, storage bytes, trainable numel, trainable bytes, saved, working
    # set, input bytes, segments that start a piece), then last forward segment, segments, place in
    # forward and in backward order, and the units in forward and in backward order (-1 padded)
    u_i = np.zeros((14, n), np.int64)
    u_i[8:, :] = -1
    u_i[9, :] = 0
    # forward, backward, selective-op's recompute and overhead, full checkpointing's recompute, gradient
    # elements of its segments, trainable bytes
    u_f = np.zeros((7, n), np.float64)
    seen = np.zeros(keep_of.shape[0], np.bool_)
    u_i[12, 0], u_i[10, n - 1] = n - 1, 0  # the root comes first in forward order
    runs = 1
    s = 0
    i = 0
    while i < ne:
        pc, u = e_piece[i], own[i]
        j = i + 1
        while j < ne and e_piece[j] == pc and own[j] == u:
            j += 1
        f, b, sv, out, gn = e_time[0, i], e_time[1, i], e_int[0, i], e_int[1, i], e_int[2, i]
        sf, so, sk, rf = sel_rerun[i], e_time[3, i], e_int[5, i], rerun[i]
        for k in range(i + 1, j):
            rf += rerun[k]
            sf += sel_rerun[k]
            so += e_time[3, k]
            sk += e_int[5, k]
            f += e_time[0, k]
            b += e_time[1, k]
            sv += e_int[0, k]
            if e_int[1, k] > out:
                out = e_int[1, k]
            gn += e_int[2, k]
        keep = 0
        if not seen[pc]:
            keep = keep_of[pc]
            seen[pc] = True
        seg_u[s] = u
        seg_f[0, s], seg_f[1, s], seg_f[2, s], seg_f[3, s] = f, b, sv, out
        seg_f[4, s], seg_f[5, s], seg_f[6, s] = gn, int(_backward_work(e_int, i, j, reduce_elem)), keep
        seg_f[7, s], seg_f[8, s], seg_f[9, s], seg_f[10, s] = sf, sk + keep, so, rf
        u_f[0, u] += f
        u_f[1, u] += b
        u_f[2, u] += sf
        u_f[3, u] += so
        u_f[4, u] += rf
        u_f[5, u] += gn
        u_i[4, u] += sv
        if out > u_i[5, u]:
            u_i[5, u] = out
        if keep:
            u_i[7, u] += 1
        u_i[8, u] = s
        u_i[9, u] += 1
        if u_i[10, u] < 0:  # its first segment
            u_i[10, u] = runs
            u_i[12, runs] = u
            runs += 1
        s += 1
        i = j
    return seg_u, seg_f, s, u_i, u_f, runs


def _add_parameters(p_anc, p_vals, unit_of, u_i):  # noqa: ANN001, ANN202
    """Each parameter module's (elements, bytes, trainable elements and bytes) to the unit that
    owns it: its innermost ancestor a unit lists, else the root."""
    n, depth = u_i.shape[1], p_anc.shape[1]
    for p in range(p_anc.shape[0]):
        o = n - 1
        for d in range(depth):
            a = p_anc[p, d]
            if a < 0:
                break
            if unit_of[a] >= 0:
                o = unit_of[a]
                break
        for c in range(4):
            u_i[c, o] += p_vals[c, p]


def _backward_order(seg_u, s, u_i):  # noqa: ANN001, ANN202
    """Backward order: post-forward order reversed (last forward segment, latest first)."""
    n = u_i.shape[1]
    k = 0
    for t in range(s - 1, -1, -1):
        u = seg_u[t]
        if u_i[11, u] < 0:
            u_i[11, u] = k
            u_i[13, k] = u
            k += 1
    if u_i[11, n - 1] < 0:  # a root without segments comes last
        u_i[11, n - 1] = k
        u_i[13, k] = n - 1


# The functions layout_kernel calls: numba compiles them with it (``backend.compile_kernels``), the one
# called per segment without reference counting, as the step loop's per-event helpers (See [Note:
# compiled step loop] in backend.py).
LAYOUT_HELPERS = (_unit_of_modules, _call_owners, _segments, _add_parameters, _backward_order)
PER_SEGMENT_HELPERS = (_backward_work,)


def lookup(keys, values, x):  # noqa: ANN001
    """``values`` at the place of each of ``x`` in the sorted ``keys`` (NaN where ``x``
    is not a key), and how many were not: the simulator's tables by size."""
    at = np.searchsorted(keys, x)
    out = np.empty(x.shape[0], np.float64)
    missing = 0
    for i in range(x.shape[0]):
        if at[i] < keys.shape[0] and keys[at[i]] == x[i]:
            out[i] = values[at[i]]
        else:
            out[i] = np.nan
            missing += 1
    return out, missing


def merge(keys, values, new_keys, new_values):  # noqa: ANN001
    """Two sorted tables with no key in common, as one sorted table (keys, values)."""
    n, m = keys.shape[0], new_keys.shape[0]
    out_k = np.empty(n + m, np.float64)
    out_v = np.empty(n + m, np.float64)
    i = j = 0
    for k in range(n + m):
        if j >= m or (i < n and keys[i] < new_keys[j]):
            out_k[k], out_v[k] = keys[i], values[i]
            i += 1
        else:
            out_k[k], out_v[k] = new_keys[j], new_values[j]
            j += 1
    return out_k, out_v
