"""The step loop of ``simulate.py``: forward and backward over the segments, on two lanes.

One function, two ways to run it. See [Note: compiled step loop]. This file
also compiles ``kernels.py``'s ``layout_kernel`` and the simulator's table
``lookup`` and ``merge`` (``compile_kernels``), and holds ``Backend``, which
says how a ``Simulator`` runs them.

[Note: compiled step loop] The loop is written over plain sequences and
floats so that numba (the optional ``wrapopt[fast]`` extra) can compile it
unchanged; without numba, or with ``WRAPOPT_JIT=0``, or for a
``Simulator(..., backend="python")``, the same source runs as Python on
tuples. Both give the same floats: the arithmetic is the same operations in
the same order (``tests/cost/test_step.py`` checks the two agree exactly). The
semantics are the notes at the top of ``simulate.py``; this file holds no
modelling decision of its own. numba is imported when the first plan is
scored, not with wrapopt; compiling costs 7-10 s once per machine (cached on
disk, ``cache=True``; loading it ~0.5 s per process), and compiled code that
fails falls back to Python with a warning (for the ``Backend`` it failed in).

[Note: step loop inputs] The loop reads five named tuples: the layout's
``Segments`` and ``UnitLayout``, the plan's ``UnitPlan`` and ``PlanScalars``,
and the simulator's ``StepConstants`` (built once); ``Backend.step`` returns
a ``StepResult``. numba (0.68) compiles named tuples of arrays and scalars as
they are, but types a named tuple argument in Python on every call, where a
plain tuple's type is found in C: with arguments of these sizes and a
trivial body, a call took ~7.5 us against ~4 us, and returning a named
tuple ~1.9 us against ~0.4 us, while scoring a plan whose layout is cached
takes ~25 us in all. So the compiled ``step_loop`` is given plain tuples
(``x[:]``, in field order) and returns one. Its first lines unpack the five
inputs by position, in their fields' order (asserted against ``_fields`` at
import): named or plain, the same line reads both, for free in compiled code
and in ~0.3 us as Python, where naming them again (``Segments(*segs)``) and
reading the names took ~1.9 us (a separate compiled entry building them cost
~0.4 us; inlining it doubled the compile time). The per-plan named tuples
are built by ``tuple.__new__(Cls, fields)`` (~0.15 us, against ~0.3 us with
keywords and ~0.2 us by ``Cls._make``): these records are built on every
scoring, so their cost is the simulator's speed.

Events are recorded (``record``) as rows of ``ev``: lane, kind, unit, start,
end, memory, with the codes below.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from wrapopt.cost.kernels import layout_kernel

_new = tuple.__new__  # a named tuple from a tuple of its fields, the fastest way: See [Note: simulator speed]

COMPUTE, COMM = 0, 1
LANES = ("compute", "comm")
FWD, LOSS, RECOMPUTE, BWD, ALL_GATHER, REDUCE_SCATTER = range(6)
KINDS = ("fwd", "loss", "recompute", "bwd", "all_gather", "reduce_scatter")


# -- the step loop's inputs and result: See [Note: step loop inputs] ---------------------------


class Segments(NamedTuple):
    """The segments a step walks, as columns in forward order (the fields of
    ``layout.Segment``; See [Note: segments] in ``layout.py``)."""

    unit: Any  # the unit that owns it (int)
    fwd_s: Any
    bwd_s: Any
    saved: Any  # activation bytes it saves
    work: Any  # working set: largest module output in the segment
    grad_numel: Any  # gradient elements that appear during its backward
    bwd_work: Any  # most its backward holds beyond its saved activations and earlier gradients
    keep: Any  # what checkpointing keeps of its block (on a block's first segment; else 0)


class UnitLayout(NamedTuple):
    """Per unit, what the layout fixes (not the per-unit choices or the mesh)."""

    forward: Any  # the units that run, in forward order of their first segment
    backward: Any  # the same in backward order (post-forward order reversed)
    last_fwd: Any  # per unit: its last forward segment
    fwd_pos: Any  # per unit: its place in ``forward`` (-1: never runs)
    bwd_pos: Any  # per unit: its place in ``backward``
    num_segments: Any
    seg_grad_numel: Any  # gradient elements that appear during its segments' backward (float)
    trainable_bytes: Any  # float


class UnitPlan(NamedTuple):
    """Per unit, what the plan makes of it: bytes and collective times on its mesh, and its choices."""

    gathered_bytes: Any  # unsharded parameters
    grad_bytes: Any  # unsharded gradients
    all_gather_s: Any
    reduce_scatter_s: Any
    all_reduce_s: Any  # across the replicas (HSDP)
    regather_s: Any  # backward all-gather (0: kept since forward): See [Note: reshard after forward]
    kept_bytes: Any  # what it keeps of its parameters between forward and backward
    checkpoint: Any  # bool


# [Note: collective copies] gloo's all-gather and reduce-scatter allocate a buffer of the
# collective's unsharded size while they run, free again by the time the collective is waited
# on (measured with the profiler's memory events, 2 ranks: 10 MiB for a 10 MiB all-gather output
# or reduce-scatter input); ``FabricProfile.collective_copies`` states it per backend (NCCL and
# analytical fabrics: 0). So an all-gather holds its output and that copy while it runs; by its
# copy-out the copy is gone. A reduce-scatter's copy adds nothing to its copy-in: FSDP2 frees the
# unsharded gradients once copied into the input buffer (``foreach_reduce``), before it runs.
# [Note: shard group of one] A shard group of one gathers and reduce-scatters nothing: no copy, no per-unit
# overhead in forward (FSDP2 only copies; charging it put no-shard's forward 2.5 ms slow, median of 52 runs).


class StepConstants(NamedTuple):
    """What the profiles and step options fix for every plan a ``Simulator`` scores. See
    the notes in ``simulate.py``."""

    reduce_elem_bytes: float  # bytes per gradient element in the reduce-scatter
    overlap_compute: float  # 1 + slowdown of overlapped compute: See [Note: overlap]
    overlap_comm: float  # 1 + slowdown of overlapped collectives
    unit_overhead_s: float  # FSDP2's work per unit per all-gather
    checkpoint_overhead_s: float  # per checkpointed block
    loss_s: float  # See [Note: loss]
    loss_work_bytes: float  # what memory holds while the loss runs
    output_bytes: float  # the model's output
    loss_saved_bytes: float  # what the loss saves for its backward
    collective_copy: float  # See [Note: collective copies]


class PlanScalars(NamedTuple):
    """The rest of one plan's inputs."""

    static_bytes: float  # sharded parameters, optimizer state, accumulated gradients: See [Note: memory]
    shard_size: float  # how far the loop divides gradients as they land (inf: already sharded)
    prefetch_depth: int  # forward all-gathers issued this many units ahead
    record: bool  # record events into ``ev``
    gathers: bool  # the shard group has more than one rank (a group of one gathers nothing)


class StepResult(NamedTuple):
    fwd_end: float
    bwd_end: float
    end: float  # when the last collective lands
    comm_s: float  # all collectives' time
    peak_bytes: float
    # at the peak: sharded gradients, gathered, all-gather buffer, unsharded gradients, activations, working set
    peak_parts: tuple[float, float, float, float, float, float]
    num_events: int

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


def step_loop(segs: Segments, lay: UnitLayout, units: UnitPlan, plan: PlanScalars, k: StepConstants,  # noqa: PLR0913
              ev: Any) -> tuple[Any, ...]:
    """One step's forward and backward over ``segs``, recording events into ``ev`` when
    ``plan.record`` (its rows: at least ``3 * units + 3 * segments + 2``). Takes the named
    tuples or plain tuples in their field order, and returns ``StepResult``'s fields as a
    plain tuple: See [Note: step loop inputs]."""
    # The inputs unpacked in their fields' order (checked below the function): in Python ~0.3 us,
    # against ~1.9 us to name them again and read the names. See [Note: step loop inputs].
    seg_u, seg_f, seg_b, seg_saved, seg_work, seg_gn, seg_bw, seg_keep = segs  # Segments
    order, border, last_fwd, pos, bpos, nseg, seg_grads, tbytes = lay  # UnitLayout
    P, G, ag, rs, ar, rag, keep, ck = units  # UnitPlan
    static, shard, depth, record, gathers = plan  # PlanScalars
    reduce_elem, ovl_c, ovl_m, unit_oh, ck_oh, loss_dur, loss_work, out_b, loss_saved, copy = k  # StepConstants
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
            t = max(t, ag_end[u]) + (unit_oh if gathers else 0.0)  # See [Note: shard group of one]
            # copy-out: the output beside the unsharded parameters, the previous one freed first (See [Note: all-gather buffer])
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
        t, peak, parts, ne = _compute(t, seg_f[si], c, ovl_c1, static, sharded_grads, gathered, ag_buffer, acts,
                                      grads_pending, seg_work[si] * 1.0, peak, parts, record, ev, ne, FWD, u)
        # Checkpointing wraps each of the unit's blocks: each keeps only its boundary tensor.
        acts += seg_keep[si] if ck[u] else seg_saved[si]
        if si == last_fwd[u]:
            gathered -= P[u] - keep[u]  # reshard after forward
    ag_buffer = 0.0  # the root's post-forward frees the last all-gather output: See [Note: all-gather buffer]
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
            # See [Note: pre-backward] in simulate.py: the first segment's all-gathers run beside the output's gradient.
            arriving = out_b * 1.0 if si == nsg - 1 else 0.0
            if rag[u] > 0 and not bissued[u]:
                c, d, gathered, peak, parts, ne = _all_gather(u, t, rag[u], P[u] - keep[u], c, t, ovl_m, static,
                    sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne, arriving, copy)
                comm_total += d
                bag_end[u] = c
                bissued[u] = True
            t = max(t, bag_end[u]) + (unit_oh if rag[u] > 0 else 0.0)
            if rag[u] > 0:  # copy-out transient; freed at once in backward
                m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + arriving + P[u]
                if m > peak:
                    peak, parts = m, (sharded_grads, gathered, ag_buffer, grads_pending, acts, arriving + P[u])
            k = bpos[u] + 1  # backward prefetch of the next unit (FSDP2 default)
            if k < nborder:
                x = border[k]
                if rag[x] > 0 and not bissued[x]:
                    c, d, gathered, peak, parts, ne = _all_gather(x, t, rag[x], P[x] - keep[x], c, t, ovl_m, static,
                        sharded_grads, gathered, ag_buffer, acts, grads_pending, peak, parts, record, ev, ne, arriving, copy)
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
            # See [Note: collective copies]: the gradients are freed before the collective's copy.
            m = static + sharded_grads + gathered + ag_buffer + acts + grads_pending + G[u] * (copy if copy > 1.0 else 1.0)
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
            t += unit_oh
    bwd_end = t
    return fwd_end, bwd_end, max(t, c), comm_total, peak, parts, ne  # StepResult's fields


# step_loop unpacks its inputs by position: these are the orders it reads.
assert Segments._fields == ("unit", "fwd_s", "bwd_s", "saved", "work", "grad_numel", "bwd_work", "keep")
assert UnitLayout._fields == ("forward", "backward", "last_fwd", "fwd_pos", "bwd_pos", "num_segments", "seg_grad_numel",
                              "trainable_bytes")
assert UnitPlan._fields == ("gathered_bytes", "grad_bytes", "all_gather_s", "reduce_scatter_s", "all_reduce_s",
                            "regather_s", "kept_bytes", "checkpoint")
assert PlanScalars._fields == ("static_bytes", "shard_size", "prefetch_depth", "record", "gathers")
assert StepConstants._fields == ("reduce_elem_bytes", "overlap_compute", "overlap_comm", "unit_overhead_s",
                                 "checkpoint_overhead_s", "loss_s", "loss_work_bytes", "output_bytes",
                                 "loss_saved_bytes", "collective_copy")


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


@dataclass(frozen=True, slots=True)
class Kernels:
    """The compiled (numba) functions a ``Backend`` runs: See [Note: compiled step loop]."""

    step: Callable  # ``step_loop``, given plain tuples: See [Note: step loop inputs]
    layout: Callable  # ``kernels.layout_kernel``: See [Note: layout kernel] in ``layout.py``
    lookup: Callable
    merge: Callable


_COMPILED: dict[str, Kernels] = {}  # compiled once per process; numba caches them on disk


def compile_kernels() -> Kernels:
    """The compiled step loop, layout kernel, ``lookup`` and ``merge``, compiled (or loaded
    from numba's disk cache) on the first call in a process.

    numba is imported here, on first use, not with wrapopt (it takes ~1 s): the one
    lazy import of this package. Raises ``ImportError`` without numba."""
    if not _COMPILED:
        import numba
        from numba.extending import register_jitable

        for helper in (_rec, _all_gather, _compute):  # step_loop calls them: numba compiles them with it
            register_jitable(helper)
        jit = numba.njit(cache=True)
        _COMPILED["kernels"] = Kernels(step=jit(step_loop), layout=jit(layout_kernel), lookup=jit(lookup), merge=jit(merge))
    return _COMPILED["kernels"]


class Backend:
    """How a ``Simulator`` (and its ``Layouts``) runs the step loop, the layout build and
    the tables of collective times: compiled by numba or as Python. Each ``Simulator``
    owns one. See [Note: compiled step loop].

    ``Backend("compiled")`` compiles on first use (``compile_kernels``);
    ``Backend("compiled", kernels=...)`` runs the given functions (tests use it to
    break one). A compiled backend whose code fails falls back to Python for the rest
    of its life, with a warning (``fall_back``).
    """

    __slots__ = ("_name", "_kernels")

    def __init__(self, name: str = "python", *, kernels: Kernels | None = None):
        if name not in ("compiled", "python"):
            raise ValueError(f"backend {name!r}: expected 'compiled' (numba) or 'python'")
        if name == "compiled" and kernels is None and importlib.util.find_spec("numba") is None:
            raise ValueError("backend 'compiled' needs numba, which is not installed: `pip install wrapopt[fast]`, "
                             "or use backend='python'")
        self._name, self._kernels = name, kernels if name == "compiled" else None

    @classmethod
    def default(cls) -> Backend:
        """Compiled when numba is installed, unless the environment sets ``WRAPOPT_JIT=0``."""
        off = os.environ.get("WRAPOPT_JIT", "1") == "0"
        return cls("python" if off or importlib.util.find_spec("numba") is None else "compiled")

    @classmethod
    def of(cls, backend: str | Backend | None) -> Backend:
        """``backend`` itself, one made from its name, or the default one (None)."""
        if backend is None:
            return cls.default()
        return backend if isinstance(backend, Backend) else cls(backend)

    @property
    def name(self) -> str:
        """'compiled' or 'python' (after a fall-back: 'python')."""
        return self._name

    @property
    def kernels(self) -> Kernels | None:
        """The compiled functions, or None to run Python."""
        if self._name != "compiled":
            return None
        if self._kernels is None:
            try:
                self._kernels = compile_kernels()
            except Exception as e:  # noqa: BLE001 - numba present but failing to import or compile
                self.fall_back(f"{type(e).__name__}: {e}")
                return None
        return self._kernels

    def fall_back(self, reason: str) -> None:
        """Run Python from now on, saying why."""
        if self._name == "compiled":
            warnings.warn(f"wrapopt: compiled code failed ({reason}); using the Python one", stacklevel=3)
        self._name, self._kernels = "python", None

    def step(self, segs: Segments, lay: UnitLayout, units: UnitPlan, plan: PlanScalars, k: StepConstants,  # noqa: PLR0913
             ev: Any) -> StepResult:
        """``step_loop``, compiled or as Python: columns as numpy arrays for the compiled
        one, as tuples or lists for Python (``step_loop`` reads both the same way)."""
        kernels = self._kernels
        if kernels is None and self._name == "compiled":
            kernels = self.kernels
        if kernels is None:
            return _new(StepResult, step_loop(segs, lay, units, plan, k, ev))
        # x[:]: the fields as a plain tuple (tuple(x) takes ~2x as long); tuple.__new__: ~0.08 us, _make ~0.12
        return _new(StepResult, kernels.step(segs[:], lay[:], units[:], plan[:], k[:], ev))

    def __repr__(self) -> str:
        return f"Backend({self._name!r})"
