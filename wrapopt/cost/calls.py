"""Module calls as the layout reads them: each module's times and sizes
(``module_calls``), where gradients appear in backward (``gradient_sites``) and
what a run of calls holds in backward (``backward_working_set``). Everything
here depends on the model, the compute profile and the batch, not on the plan;
``layout.py`` groups it by the plan's units.

[Note: gradient sites] A parameter's unsharded gradient appears when backward
reaches the first module using it in backward order: for a tied parameter
(embedding and output head) that is the use that ran last in forward, so the
gradient lives through the whole backward until its unit's reduce-scatter.
Every other use (the other tied modules, a module called more than once)
accumulates into it: for that moment the new gradient and the sum are held
besides the old one. Parameters another module's forward reads
(``ModelGraph.param_users``: ``nn.MultiheadAttention``'s ``out_proj``, which
never runs itself) are placed the same way, among the modules that use them.

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
from collections.abc import Callable, Sequence
from typing import NamedTuple

from dataclasses import replace

from wrapopt.cost.roofline import kernel_times
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.spec import ROOT, ModelGraph, ModuleInfo
from wrapopt.units import ancestors

__all__ = ["Entry", "backward_working_set", "gradient_sites", "module_calls", "module_time", "recompute_share",
           "recomputed", "region_depths", "twin_times"]


class Entry(NamedTuple):
    """One module's calls, as the layout reads them (sizes and times scaled by the batch)."""

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
    # Selective-op checkpointing (See [Note: selective checkpointing] in wrapopt/selective.py): the
    # forward seconds it recomputes (its ops but matmuls and attention) and the bytes it keeps,
    # and what torch's selective dispatch modes add to each pass, its forward and its recompute.
    sel_fwd_s: float
    sel_kept: int
    sel_ops_s: float
    # Per ancestor in ``anc``: the share of its kernels' time (``fwd_s`` less ``call_s``) a checkpoint
    # around that ancestor does not recompute (See [Note: early stop] in wrapopt/trace/record.py);
    # the per-call overhead is paid still: the module is called, its kernels do not run.
    skip: tuple[float, ...]
    call_s: float


def module_calls(graph: ModelGraph, compute: ComputeProfile, scale: float, piece: Callable[[str], str]) -> list[Entry]:
    """One ``Entry`` per module that runs, in call order: times from the profile's
    measured module times when it has them, else FLOPs / throughput + bytes of
    memory-bound ops / op bandwidth, + a per-call overhead; sizes scaled by ``scale``
    (the batch); ``piece``: a module's block."""
    measured = {fqn: (f, b) for fqn, f, b in compute.module_times}
    grad_at, acc_at = gradient_sites(graph)
    early = {m.fqn: dict(m.early_stop) for m in graph.modules if m.early_stop}
    entries = []
    for m in graph.call_order():
        anc = ancestors(m.fqn)
        f, b = module_time(m, compute, scale, measured)
        sel_f = f * recompute_share(m, compute) if measured else (
            (f - compute.module_overhead_s * m.num_calls) * recompute_share(m, compute)
            + compute.module_overhead_s * m.num_calls)
        # The root's "output" is the model's, made by its last child: its own ops' working set is not it.
        out = 0 if m.fqn == ROOT else m.output_bytes
        entries.append(Entry(m.fqn, anc, f, b, int(m.saved_bytes * scale),
                             int(out * scale), grad_at.get(m.fqn, 0), piece(m.fqn), acc_at.get(m.fqn, 0),
                             int((0 if m.fqn == ROOT else m.input_bytes) * scale), sel_f,
                             int(m.selective_kept_bytes * scale), compute.selective_op_overhead_s * m.fwd_ops,
                             tuple(early.get(a, {}).get(m.fqn, 0.0) for a in anc),
                             0.0 if measured else compute.module_overhead_s * m.num_calls))
    return entries


# [Note: twin blocks] A measured profile times every module on its own (See [Note: measured
# module times] in hardware/measure_device.py), so the blocks of a chain, which run the same
# kernels on the same shapes, come out different: a 5-step median of a 5 ms call moves by 3-10x
# on a shared CPU (zoo:mha-tied, 2 gloo ranks: one attention of eight at 48 ms, the others 4-5;
# rerun, another one). The search reads those differences as real and exploits them: it
# checkpoints the blocks that drew cheap forwards and merges around them (issue 51: 7 blocks
# kept unsharded, 3 checkpointed, predicted faster than per-block by more than its error,
# measured 12% slower). So the simulator prices twin modules alike: the modules at the same
# place in the blocks of one chain, of the same class, FLOPs, bytes, parameters and calls, each
# take the mean of the group's measured times (the mean keeps the step's total, pauses
# included, which the shares of the whole forward were scaled to keep).
def twin_times(graph: ModelGraph, compute: ComputeProfile) -> ComputeProfile:
    """``compute`` with the measured times of twin modules pooled: See [Note: twin blocks]."""
    if not compute.module_times or not graph.block_chains:
        return compute
    chain_of = {block: c for c, chain in enumerate(graph.block_chains) for block in chain}
    key_of: dict[str, tuple] = {}
    for m in graph.modules:
        block = next((a for a in ancestors(m.fqn) if a in chain_of), None)
        if block is not None:  # the innermost block holding it (a block inside a block is one of its own chain)
            key_of[m.fqn] = (chain_of[block], m.fqn[len(block):], m.cls, m.fwd_flops, m.bwd_flops, m.fwd_bytes,
                             m.bwd_bytes, m.total_numel, m.num_calls, m.output_bytes, m.input_bytes,
                             m.attention_run_flops)
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for fqn, f, b in compute.module_times:
        if fqn in key_of:
            groups.setdefault(key_of[fqn], []).append((f, b))
    mean = {k: (sum(f for f, _ in v) / len(v), sum(b for _, b in v) / len(v)) for k, v in groups.items()}
    times = tuple((fqn, *mean[key_of[fqn]]) if fqn in key_of else (fqn, f, b) for fqn, f, b in compute.module_times)
    return replace(compute, module_times=times)


# [Note: batch scaling] A module's time at another batch (``SimOptions.batch_scale``: a
# pipeline's micro-batch, a split of the global batch, a tensor-parallel group's share) is its
# time at the traced batch times the scale, but for the part that does not shrink with the batch:
# per-op dispatch and kernel launches, and the efficiency small shapes lose. A measured profile
# measures that part on the model itself (``measure_batch_fixed_share``: forward + loss + backward
# of the whole model at its batch and at half of it, interleaved; the share k with
# t(s) = t(1) x (k + (1 - k) s) through both), and ``module_time`` prices every measured module
# by it. Profiles without it (0, as every file
# written before it, and the analytical ones: their kernels are priced from shapes, with a fixed
# per-call overhead) scale linearly. The loss stays linear (one large op on the logits).
def module_time(m: ModuleInfo, compute: ComputeProfile, scale: float,
                measured: dict[str, tuple[float, float]] | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one module's own ops over all its calls at batch ``scale``:
    the profile's measured time when it has module times, else each kernel priced from its shape
    on a stated GPU ([Note: kernel roofline] in roofline.py) or FLOPs / throughput, + bytes of
    memory-bound ops / op bandwidth, + a per-call overhead."""
    if measured is None:
        measured = {fqn: (f, b) for fqn, f, b in compute.module_times}
    if measured:  # See [Note: batch scaling]
        f, b = measured.get(m.fqn, (0.0, 0.0))
        k = compute.batch_fixed_share
        return f * (k + (1 - k) * scale), b * (k + (1 - k) * scale)
    if compute.matmul_flops_per_s:  # a stated GPU: See [Note: kernel roofline] in roofline.py
        times = kernel_times(m, compute).values()
        f, b = sum(t[0] for t in times), sum(t[1] for t in times)
    else:
        f, b = m.fwd_flops / compute.flops_per_s, m.bwd_flops / compute.flops_per_s
        if compute.op_bandwidth_bytes_per_s:  # See [Note: memory-bound ops] in trace/op_bytes.py
            f += m.fwd_bytes / compute.op_bandwidth_bytes_per_s
            b += m.bwd_bytes / compute.op_bandwidth_bytes_per_s
    # The per-call overhead is paid once per call, whatever the batch.
    oh = compute.module_overhead_s * m.num_calls
    return f * scale + oh, b * scale + oh


def recompute_share(m: ModuleInfo, compute: ComputeProfile) -> float:
    """The share of a module's forward time (without per-call overhead) that selective-op
    recomputes: its ops other than the matmuls and attention it keeps (norms, activations,
    elementwise, other FLOP ops such as convolutions, and every second mm:
    ``ModuleInfo.selective_mm_recompute``), by the profile's kernel model (``kernel_times``). A
    measured profile has no per-op times: its module's measured forward is split by this same
    modelled share. See [Note: selective checkpointing] in wrapopt/selective.py."""
    times = kernel_times(m, compute)
    total = sum(f for f, _b in times.values())
    if total <= 0:
        return 0.0
    mm_flops = sum(row[0] * row[-1] for row in m.matmuls) * (1.0 - m.selective_mm_recompute)
    if compute.matmul_flops_per_s:  # GEMM: the matmul table and any other FLOP op, at one rate
        flop_ops = max(m.fwd_flops - m.attention_flops, 0.0)
        gemm = times["GEMM"][0] + times.get("GEMM fp8", (0.0, 0.0))[0]
        kept = times["attention"][0] + gemm * (min(1.0, mm_flops / flop_ops) if flop_ops else 0.0)
    else:  # every FLOP op at one rate
        kept = times["GEMM"][0] * (min(1.0, (mm_flops + m.attention_flops) / m.fwd_flops) if m.fwd_flops else 0.0)
    return min(1.0, max(0.0, 1.0 - kept / total))


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
    # A module's parameters read by other modules' forward (whole modules: a module
    # with some parameters read elsewhere and some by itself is placed as if all were).
    users: dict[str, list[str]] = {}
    for module, user in graph.param_users:
        users.setdefault(module, [module]).append(user)
    for module, uses in users.items():
        n = grad_at.get(module, 0)
        ran = [o for o in dict.fromkeys(uses) if order.get(o, -1) >= 0]
        if not n or not ran or ran == [module]:
            continue
        last = max(ran, key=lambda o: order[o])
        grad_at[module] -= n
        grad_at[last] = grad_at.get(last, 0) + n
        for o in ran:
            if o != last:
                acc_at[o] = acc_at.get(o, 0) + n
    for m in graph.modules:
        if m.num_calls > 1 and m.own_trainable_numel:
            acc_at[m.fqn] = acc_at.get(m.fqn, 0) + m.own_trainable_numel
    return grad_at, acc_at


def backward_working_set(entries: Sequence[Entry], reduce_elem: float) -> int:
    """Most bytes a segment of ``entries`` holds in backward beyond its saved activations and
    the gradients before it (``reduce_elem``: bytes per gradient element). See [Note:
    progressive backward]."""
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


def region_depths(entries: Sequence[Entry], index: dict[str, int]) -> tuple[int, ...]:
    """Per entry, the depth in its ancestors of the unit module that owns it (the module a
    checkpoint wraps; ``index``: unit module -> unit), -1 where none does (the root's)."""
    out = []
    for e in entries:
        for d, a in enumerate(e.anc):
            if a in index:
                out.append(d)
                break
        else:
            out.append(-1)
    return tuple(out)


def recomputed(entries: Sequence[Entry], depths: tuple[int, ...]) -> tuple[float, float]:
    """What full and selective-op checkpointing recompute of ``entries``, each checkpointed by its
    ancestor at ``depths`` (-1: none): its kernels less the share after the early stop, and its
    per-call overhead (See [Note: early stop] in wrapopt/trace/record.py). Summed in call order,
    as the layout kernel does (``kernels.layout_kernel``)."""
    rf = sf = 0.0  # 0.0 + x is x: the same sums as the kernel's, which start from the first entry
    for e, d in zip(entries, depths):
        rf += e.fwd_s if d < 0 else e.fwd_s - e.skip[d] * (e.fwd_s - e.call_s)
        sf += e.sel_fwd_s if d < 0 else e.sel_fwd_s - e.skip[d] * (e.sel_fwd_s - e.call_s)
    return rf, sf
