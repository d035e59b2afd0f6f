"""The step loop of ``simulate.py``: forward and backward over the segments, on two lanes.

One function, two ways to run it. See [Note: compiled step loop]. This file
also compiles ``kernels.py``'s ``layout_kernel`` and the simulator's table
``lookup`` (``kernels()``).

[Note: compiled step loop] The loop is written over plain sequences and
floats so that numba (the optional ``wrapopt[fast]`` extra) can compile it
unchanged; without numba, or with ``WRAPOPT_JIT=0``, the same source runs as
Python on tuples. Both give the same floats: the arithmetic is the same
operations in the same order (``tests/test_cost.py`` checks the two agree
exactly). The semantics are the notes at the top of ``simulate.py``; this file
holds no modelling decision of its own. numba is imported when the first
plan is scored, not with wrapopt; compiling costs 7-10 s once per machine
(cached on disk, ``cache=True``; loading it ~0.5 s per process), and
compiled code that fails falls back to Python with a warning.

Events are recorded (``record``) as rows of ``ev``: lane, kind, unit, start,
end, memory, with the codes below.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import numpy as np

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
                grads_pending, peak, parts, record, ev, ne):
    """Issue unit ``u``'s all-gather (``dur`` seconds, ``nbytes`` gathered) at ``at`` on
    the comm lane, behind what is queued there (See [Note: overlap]). Returns (its
    end, its duration, gathered bytes, peak, peak parts, events recorded)."""
    start = at if at > c else c
    d = dur * (ovl_m if t > start else 1.0)
    gathered += nbytes
    m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending
    if m > peak:
        peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, 0.0)
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


def step_loop(segs, units, order, border, static, shard, reduce_elem, ovl_c, ovl_m, unit_oh, ck_oh,  # noqa: ANN001
              runs_ahead, depth, loss_dur, loss_work, out_b, loss_saved, record, ev):
    """One step's forward and backward. Returns (forward end, backward end, last
    collective end, comm total, peak, peak parts, events recorded)."""
    seg_u, seg_f, seg_b, seg_saved, seg_work, seg_gn, seg_bw, seg_keep = segs
    P, G, ag, rs, ar, rag, keep, ck, last_fwd, pos, bpos, nseg, seg_grads, tbytes = units
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
    ag_buffer = P[order[norder - 1]] * 1.0 if runs_ahead else 0.0  # the previous step's last
    ag_end = [0.0] * n
    issued = [False] * n
    seen = [False] * n
    u = order[0]
    c, d, gathered, peak, parts, ne = _all_gather(u, 0.0, ag[u], P[u], c, t, ovl_m, static,
        sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne)
    comm_total += d
    ag_end[u] = c
    issued[u] = True
    for si in range(nsg):
        u = seg_u[si]
        if not seen[u]:
            seen[u] = True
            if not issued[u]:  # issued when compute reaches the unit
                c, d, gathered, peak, parts, ne = _all_gather(u, t, ag[u], P[u], c, t, ovl_m, static,
                    sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne)
                comm_total += d
                ag_end[u] = c
                issued[u] = True
            t = max(t, ag_end[u]) + unit_oh
            # copy-out: the all-gather output beside the unsharded parameters
            m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + P[u]
            if m > peak:
                peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, P[u] * 1.0)
            if runs_ahead:
                ag_buffer = P[u] * 1.0  # See [Note: all-gather buffer]
            if depth:  # prefetch `depth` units ahead, issued at this unit's pre-forward
                k = pos[u] + depth
                if k < norder and not issued[order[k]]:
                    x = order[k]
                    c, d, gathered, peak, parts, ne = _all_gather(x, t, ag[x], P[x], c, t, ovl_m, static,
                        sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne)
                    comm_total += d
                    ag_end[x] = c
                    issued[x] = True
        t, peak, parts, ne = _compute(t, seg_f[si], c, ovl_c1, static, sharded_grads, gathered, ag_buffer, acts,
                                      grads_pending, seg_work[si] * 1.0, peak, parts, record, ev, ne, FWD, u)
        # Checkpointing wraps each of the unit's blocks: each keeps only its boundary tensor.
        acts += seg_keep[si] if ck[u] else seg_saved[si]
        if si == last_fwd[u]:
            gathered -= P[u] - keep[u]  # reshard after forward
    # See [Note: loss]: forward holds the model's output beside what the loss creates.
    t, peak, parts, ne = _compute(t, loss_dur, c, ovl_c1, static, sharded_grads, gathered, ag_buffer, acts,
                                  grads_pending, loss_work, peak, parts, record, ev, ne, LOSS, n - 1)
    acts += loss_saved
    # the loss's backward: the gradient arriving and the one leaving, beside its saved
    m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + 2 * out_b
    if m > peak:
        peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, 2 * out_b)
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
            if rag[u] > 0 and not bissued[u]:
                c, d, gathered, peak, parts, ne = _all_gather(u, t, rag[u], P[u] - keep[u], c, t, ovl_m, static,
                    sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne)
                comm_total += d
                bag_end[u] = c
                bissued[u] = True
            t = max(t, bag_end[u]) + (unit_oh if rag[u] > 0 else 0.0)
            if rag[u] > 0:  # copy-out transient; freed at once in backward
                m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + P[u]
                if m > peak:
                    peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, P[u] * 1.0)
            k = bpos[u] + 1  # backward prefetch of the next unit (FSDP2 default)
            if k < nborder:
                x = border[k]
                if rag[x] > 0 and not bissued[x]:
                    c, d, gathered, peak, parts, ne = _all_gather(x, t, rag[x], P[x] - keep[x], c, t, ovl_m, static,
                        sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne)
                    comm_total += d
                    bag_end[x] = c
                    bissued[x] = True
        if ck[u]:  # recompute this block's forward, re-saving its activations
            acts += seg_saved[si] - seg_keep[si]
            t, peak, parts, ne = _compute(t, seg_f[si] + (ck_oh if seg_keep[si] else 0.0), c, ovl_c1, static,
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
            m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + G[u]
            if m > peak:
                peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, G[u] * 1.0)
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
            t += unit_oh
    bwd_end = t
    return fwd_end, bwd_end, max(t, c), comm_total, peak, parts, ne


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


_JIT: list[Any] = []  # [(the compiled step loop, layout kernel, lookup, merge)], or [None]: filled on first use
_HELPERS_REGISTERED: list[bool] = []


def kernels() -> tuple[Callable, ...] | None:
    """The compiled step loop, layout kernel (See [Note: layout kernel] in
    ``layout.py``), ``lookup`` and ``merge``, or None to run Python.

    numba is imported on first use, not with wrapopt (it takes ~1 s)."""
    if not _JIT:
        fns = None
        if os.environ.get("WRAPOPT_JIT", "1") != "0":
            try:
                import numba
                from numba.extending import register_jitable
            except ImportError:
                pass
            else:
                from wrapopt.cost.kernels import layout_kernel

                if not _HELPERS_REGISTERED:  # step_loop calls them: numba compiles them with it
                    for helper in (_rec, _all_gather, _compute):
                        register_jitable(helper)
                    _HELPERS_REGISTERED.append(True)
                fns = tuple(numba.njit(cache=True)(fn) for fn in (step_loop, layout_kernel, lookup, merge))
        _JIT.append(fns)
    return _JIT[0]


def compiled() -> Callable | None:
    """The compiled step loop, or None to run ``step_loop`` as Python."""
    fns = kernels()
    return None if fns is None else fns[0]


def disable_jit(reason: str) -> None:
    """Fall back to Python for the rest of the process, saying why once."""
    if kernels() is not None:
        warnings.warn(f"wrapopt: compiled code failed ({reason}); using the Python one", stacklevel=3)
    _JIT[:] = [None]
