"""The tensor-parallel view of a model: what one rank of a tensor-parallel group holds
and computes, as a ``ModelGraph`` and a ``ComputeProfile`` the FSDP simulator scores
on the data-parallel mesh.

[Note: tensor parallel costs] A 2-D plan (See [Note: tensor parallel] in tp.py) is
scored as FSDP on ``mesh.data_parallel()`` of a model that is the tensor-parallel
rank's share of the real one. ``tp_view`` makes that model from the traced graph,
per module of every block the ``TPSpec`` parallelises:

- a colwise projection holds 1/tp of its weight and bias, does 1/tp of the FLOPs
  and makes 1/tp of the output; it saves its input, which is whole (replicated);
- a rowwise projection holds 1/tp of its weight (its bias is replicated), does
  1/tp of the FLOPs, and saves and reads 1/tp of its input; its output is whole;
- the module around them (the attention, with its score and softmax ops; the
  MLP, with its activation and gating) does 1/tp of its own ops and saves 1/tp,
  and so does every other module inside it ("inner": Hugging Face's ``act_fn``);
- everything else (norms, residual adds, embeddings, the head, the loss) is
  unchanged: replicated.

Time per module is the profile's (measured per module, or FLOPs and bytes over
the stated rates) as the simulator times it: the graph after the compute dtype and
the throughput knobs (compile's fusions, float8's casts: ``timed``), not the traced
one. Split modules' time is divided by ``tp * efficiency``, where the
efficiency is the profile's measured throughput of the model's largest
projection split ``tp`` ways over unsplit (``ComputeProfile.split_efficiency``;
without a measurement it is taken as 1 and the estimate says so); on a stated GPU
a split projection is priced on its own shapes instead ([Note: split matmuls]); plus, per call
of a split projection, what tensor parallelism costs beyond the matmul and the
collective (DTensor's dispatch and its input and output hooks:
``ComputeProfile.tp_overhead_s``, measured by ``measure_tp_overhead``; on a CPU,
where nothing runs ahead, it is of the order of the small matmuls themselves). The
tensor-parallel collectives are on the critical path of every block (the next
op needs their result), so they are time of the module that issues them, on the
compute lane, not overlapped with anything: forward, one all-reduce of the
rowwise projection's output per call; backward, one all-reduce of the colwise
projection's input gradient per call (the gradients of a replicated input are
partial sums on each rank). They run on a group of ``tp`` consecutive ranks
inside one node: ``FabricProfile.collective_s("all_reduce", tp, tp, bytes)``.
These counts are torch's (``CommDebugMode`` on 2-D plans, tests/plan/test_tp_ranks.py:
forward 2, backward 5 for a Llama block and 4 for a GPT block, each of the block's
activation size). A checkpointed unit is charged its whole forward again, both
all-reduces included; torch's non-reentrant checkpoint stops its recompute once
every tensor backward needs is back, which skips the MLP's output projection and
its all-reduce (measured: one all-reduce per checkpointed block, not two), so a
checkpointed 2-D plan is predicted slow by about that much.
[Note: split matmuls] On a stated GPU (the kernel roofline, [Note: kernel roofline] in
roofline.py) a split projection is priced on the shapes one rank runs, not as 1/tp
of the whole one: a colwise projection of an ``M x K`` input and a ``K x N`` weight
runs ``M x K`` times ``K x N/tp`` (its input is read whole, by every rank), a rowwise
one ``M x K/tp`` times ``K/tp x N`` (its output, a partial sum, is written whole).
The FLOPs are 1/tp, the bytes are not: for Llama 3.1 70B at tp 8 the k and v
projections (N = 128 per rank) read their 8192-wide input for 1/64 of its matmul
work, memory-bound, and a block's GEMMs take 1.15x (bf16) and 1.24x (float8) the
time of 1/8 of the whole block's (8B at tp 8: 1.29x, bf16).
The output tiles (wave quantization) are counted at the batch the view runs
(``batch_scale`` x the traced batch). ``split_matmuls`` builds the table from the
weight's shape; a projection whose matmuls are not its weight's plain product
(a tied head, a batched call) keeps the linear scaling.
[Note: sequence parallel costs] With ``TPSpec.sequence_parallel`` (See [Note:
sequence parallel] in tp.py) ``tp_roles`` adds three roles. "sequence": every
module of a block outside its split regions (the block itself, its norms, its
residual adds) and the norms and positional embeddings outside the blocks hold,
save and move 1/tp of what they did, and take 1/tp of their time; a checkpointed
block keeps 1/tp of its input. "vocab": the token embedding holds 1/tp of its
rows and outputs 1/tp of the tokens. "head": the output projection is split
column-wise like a colwise projection. A region (the attention, the MLP) takes
and returns 1/tp of the tokens; its colwise projections save the gathered input,
whole. Collectives, each of the whole activation on the tensor-parallel group:
forward, an all-gather into each region (and into the head) and a
reduce-scatter out of each rowwise projection and the embedding; backward, a
reduce-scatter of each region's input gradient and an all-gather of each
rowwise output's gradient (one all-gather plus one reduce-scatter move the bytes
of one all-reduce; the colwise projections inside a region issue none of their own:
their input gradients are DTensor ``Partial`` sums, added, then reduce-scattered
once by the region's input redistribution, as torch's CommDebugMode counts: two
all-gathers and two reduce-scatters per Llama block backward), and an all-reduce of the gradient of each parameter of a
"sequence" module (a norm's weight: each rank's is a partial sum over its
tokens). Counted against torch's CommDebugMode in tests/plan/test_tp_ranks.py.
``loss_parallel``: the model's output and what the loss saves are the rank's
vocabulary shard; torch's ``loss_parallel`` log-softmax (torch/distributed/tensor/
parallel/loss.py) keeps its shifted input beside the output while it runs (one
shard more at the loss's peak) and its backward builds the zero gradient, the
exponential and their sum (three shards beside the saved output), and it adds
three all-reduces of a float per token; the loss's time is 1/tp. Without loss
parallel the head's output is all-gathered whole.

[Note: async tensor parallel] ``TPSpec.async_tp`` prices torch's micro-pipelined
TP (symmetric memory; TorchTitan's ``enable_async_tensor_parallel``): each
sequence-parallel collective runs in ``tp`` chunks beside the matmuls it feeds
(a region's all-gather beside its colwise projections' forward) or follows (a
rowwise projection's reduce-scatter), so of a collective ``c`` beside matmuls
``m`` only ``max(c - m, 0) + min(c, m) / tp`` stays exposed; backward the same
against half of the projections' backward (the input gradients), except a
region's reduce-scatter of its input gradient when the region has more than one
colwise projection: torch's micro-pipeline pass (torch/_inductor/fx_passes/
micro_pipeline_tp.py, ``_find_producer_matmul``) fuses a reduce-scatter only with
the matmul that produces its input, and that input is the sum (an add) of the q,
k and v (or gate and up) input gradients, so it stays exposed whole. Each fused
op also runs a memory pass of its own, on the compute stream
(torch/distributed/_symmetric_memory ``_pipelined_all_gather_and_consume`` and
``_fused_matmul_reduce_scatter_impl``): an all-gather first copies the rank's
shard into its symmetric buffer (1/tp of the gathered bytes read and written); a
reduce-scatter ends by summing the ``tp`` stacked partials (the whole partial
output read, 1/tp of it written), which NCCL's reduce-scatter does inside the
collective; both at the memory-bound ops' bandwidth. It needs
sequence parallelism and NVLink 4 GPUs (``async_tp_support``; "auto" turns it on
there, ``with_async``). Memory is priced as without it.

Left out: contention between the tensor-parallel collectives and FSDP's on the
same links, and the faster fused kernels some codebases use for the
all-reduce; both are small next to the per-block collectives at the sizes
where tensor parallelism pays.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from wrapopt.cost.calls import module_time
from wrapopt.cost.dtypes import traced_dtype_bytes
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.spec import ROOT, ModelGraph, ModuleInfo
from wrapopt.spec.graph import TILE
from wrapopt.tp import TPSpec, outside_roles, tp_blocks

__all__ = ["async_tp_support", "split_matmuls", "tp_roles", "tp_view", "with_async"]


def tp_roles(graph: ModelGraph, spec: TPSpec) -> dict[str, str]:
    """Module -> "colwise", "rowwise", "region" (the module around split projections), "inner" (any
    other module inside a region, as Hugging Face's ``act_fn``), and with
    sequence or loss parallelism "sequence" (on 1/tp of the sequence), "vocab" (the embedding
    split over its rows) and "head" (the output projection, column-wise). See [Note: sequence
    parallel costs]."""
    roles: dict[str, str] = {}
    for b in tp_blocks(graph, spec):
        for rel, style in spec.styles(graph.info(b).cls).items():
            fqn = f"{b}.{rel}"
            roles[fqn] = style
            parent = fqn.rsplit(".", 1)[0]
            if parent != b:
                roles.setdefault(parent, "region")
    regions = [f for f, r in roles.items() if r == "region"]
    for region in regions:  # a region's other modules (Hugging Face's act_fn) run on the rank's heads / features
        for fqn in graph.subtree(region):
            roles.setdefault(fqn, "inner")
    if spec.sequence_parallel:
        covered = tuple(roles)
        for b in tp_blocks(graph, spec):
            for fqn in graph.subtree(b):
                if not any(fqn == c or fqn.startswith(c + ".") for c in covered):
                    roles[fqn] = "sequence"
    roles.update(outside_roles(graph, spec))
    return roles


def _split_shapes(graph: ModelGraph, roles: dict[str, str], size: int) -> tuple[tuple, dict[str, tuple[int, int]]]:
    """The parameter shapes one tensor-parallel rank holds, and (elements, bytes) removed per module."""
    shapes, removed = [], {}
    for fqn, shape, dt in graph.param_shapes:
        owner, name = fqn.rsplit(".", 1) if "." in fqn else ("", fqn)
        role, new = roles.get(owner), tuple(shape)
        if role in ("colwise", "head", "vocab") and len(shape) >= 1 and (role != "vocab" or name == "weight"):
            new = (shape[0] // size, *shape[1:])
        elif role == "rowwise" and name == "weight" and len(shape) == 2:
            new = (shape[0], shape[1] // size)
        n_old, n_new = _numel(shape), _numel(new)
        if n_new != n_old:
            n, b = removed.get(owner, (0, 0))
            removed[owner] = (n + n_old - n_new, b + (n_old - n_new) * getattr(torch, dt).itemsize)
        shapes.append((fqn, new, dt))
    return tuple(shapes), removed


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _scaled(m: ModuleInfo, role: str | None, size: int, removed: tuple[int, int], spec: TPSpec) -> ModuleInfo:
    n, nb = removed
    if n and m.own_numel:
        keep = (m.own_numel - n) / m.own_numel
        m = replace(m, own_numel=m.own_numel - n, own_bytes=m.own_bytes - nb,
                    own_trainable_numel=round(m.own_trainable_numel * keep),
                    own_trainable_bytes=round(m.own_trainable_bytes * keep),
                    own_bytes_by_dtype=tuple((d, round(b * keep)) for d, b in m.own_bytes_by_dtype))
    if role is None:
        return m
    sp = spec.sequence_parallel
    if role == "vocab":  # its output is reduce-scattered onto the sequence shards
        return replace(m, output_bytes=m.output_bytes // size)
    common = dict(fwd_flops=m.fwd_flops / size, bwd_flops=m.bwd_flops / size,
                  fwd_bytes=m.fwd_bytes // size, bwd_bytes=m.bwd_bytes // size)
    if role in ("sequence", "inner"):  # everything it holds and moves is 1/tp (of the tokens, or the features)
        return replace(m, saved_bytes=m.saved_bytes // size, output_bytes=m.output_bytes // size,
                       input_bytes=m.input_bytes // size, selective_kept_bytes=m.selective_kept_bytes // size,
                       **common)
    if role in ("colwise", "head"):
        split_out = role == "colwise" or spec.loss_parallel
        return replace(m, output_bytes=m.output_bytes // size if split_out else m.output_bytes,
                       selective_kept_bytes=m.selective_kept_bytes // size, **common)
    if role == "rowwise":
        return replace(m, saved_bytes=m.saved_bytes // size, input_bytes=m.input_bytes // size,
                       output_bytes=m.output_bytes // size if sp else m.output_bytes, **common)
    return replace(m, saved_bytes=m.saved_bytes // size, selective_kept_bytes=m.selective_kept_bytes // size,
                   input_bytes=m.input_bytes // size if sp else m.input_bytes,
                   output_bytes=m.output_bytes // size if sp else m.output_bytes, **common)


def tp_view(graph: ModelGraph, compute: ComputeProfile, fabric: FabricProfile, spec: TPSpec, size: int, *,
            batch_scale: float = 1.0, activation_dtype_bytes: int | None = None, timed: ModelGraph | None = None,
            ) -> tuple[ModelGraph, ComputeProfile, frozenset[str]]:
    """One tensor-parallel rank's graph and compute profile, and the caveats of the view.
    ``graph`` is the traced one (activations in the traced dtype), which sizes the view and its
    messages; ``timed``: the graph the simulator times, after the compute dtype and the throughput
    knobs (compile's fusions, float8's casts), default ``graph``; ``activation_dtype_bytes`` sizes
    the tensor-parallel messages as the step runs them. See [Note: tensor parallel costs]."""
    roles = tp_roles(graph, spec)
    shapes, removed = _split_shapes(graph, roles, size)
    notes: set[str] = set()
    measured = {fqn: (f, b) for fqn, f, b in compute.module_times}
    roofline = bool(compute.matmul_flops_per_s) and not measured  # a stated GPU: [Note: kernel roofline]
    split = split_matmuls(graph, roles, size, batch_scale) if roofline else {}
    eff = dict(compute.split_efficiency).get(size)
    if eff is None:
        eff = 1.0
    if eff == 1.0 and len(split) < sum(r in ("colwise", "rowwise", "head") for r in roles.values()):
        notes.add(f"tensor-parallel matmuls split {size} ways taken as fast per FLOP as whole ones: "
                  "the compute profile measured no split efficiency")
    traced = traced_dtype_bytes(graph)
    act = (activation_dtype_bytes or traced) / traced

    def coll(kind: str, nbytes: float) -> float:
        t, caveat = fabric.collective_s(kind, size, size, nbytes)
        if caveat:
            notes.add(caveat)
        return t

    oh_f, oh_b = compute.tp_overhead_s
    sp, blocks = spec.sequence_parallel, frozenset(tp_blocks(graph, spec))
    base: dict[str, list[float]] = {}  # compute time (forward, backward) per module
    comm: dict[str, list[float]] = {}  # its tensor-parallel collectives (forward, backward)
    for m in (timed or graph).call_order():
        role, mine = roles.get(m.fqn), split.get(m.fqn)
        if mine is not None:  # the rank's own shapes on the kernel roofline: See [Note: split matmuls]
            m = replace(m, matmuls=mine, fwd_flops=m.fwd_flops / size, bwd_flops=m.bwd_flops / size,
                        fwd_bytes=m.fwd_bytes // size, bwd_bytes=m.bwd_bytes // size)
        f, b = module_time(m, compute, batch_scale, measured)
        m = graph.info(m.fqn)
        if role in ("colwise", "rowwise", "region", "inner", "head"):
            f, b = f / (eff if mine is not None else size * eff), b / (eff if mine is not None else size * eff)
        elif role == "sequence":
            f, b = f / size, b / size
        if role in ("colwise", "rowwise", "head"):  # DTensor's dispatch and hooks, per call
            f += m.num_calls * oh_f
            b += m.num_calls * oh_b
        base[m.fqn] = [f, b]
        comm[m.fqn] = _collectives(m, role, spec, coll, act * batch_scale, blocks)
    if spec.async_tp and sp:
        _overlap(graph, roles, base, comm, size, act * batch_scale, compute.op_bandwidth_bytes_per_s)
    times = [(fqn, (f + comm[fqn][0]) / batch_scale, (b + comm[fqn][1]) / batch_scale) for fqn, (f, b) in base.items()]

    modules = {m.fqn: _scaled(m, roles.get(m.fqn), size, removed.get(m.fqn, (0, 0)), spec) for m in graph.modules}
    for owner, (n, nb) in removed.items():  # totals: the module and its ancestors hold that much less
        parts = owner.split(".") if owner else []
        for i in range(len(parts) + 1):
            fqn = ".".join(parts[:i])
            m = modules[fqn]
            modules[fqn] = replace(m, total_numel=m.total_numel - n, total_bytes=m.total_bytes - nb)
    lp = spec.loss_parallel and "head" in roles.values()
    if lp:  # the model's output is the head's: the logits, split over the vocabulary
        modules[ROOT] = replace(modules[ROOT], output_bytes=modules[ROOT].output_bytes // size)
    tree = graph.tree.copy()
    for fqn, m in modules.items():
        tree.nodes[fqn]["info"] = m
    view = replace(graph, modules=tuple(modules[m.fqn] for m in graph.modules), tree=tree, param_shapes=shapes)
    loss_s = compute.loss_s
    if lp:  # the loss on the vocabulary shards
        shard = graph.loss_saved_bytes // size  # log_softmax's output on this rank's vocabulary shard
        view = replace(view, loss_saved_bytes=shard, loss_peak_bytes=graph.loss_peak_bytes // size + shard,
                       loss_grad_bytes=max(graph.loss_grad_bytes // size, 3 * shard))
        tokens = graph.batch_size * graph.seq_len * batch_scale  # three all-reduces of a float per token
        loss_s = compute.loss_s / size + 3 * coll("all_reduce", 4.0 * tokens) / batch_scale
    # the times are at batch_scale already (module_time): See [Note: batch scaling] in calls.py
    return view, replace(compute, module_times=tuple(times), batch_fixed_share=0.0, loss_s=loss_s), frozenset(notes)


def split_matmuls(graph: ModelGraph, roles: dict[str, str], size: int, batch_scale: float = 1.0,
                  ) -> dict[str, tuple[tuple[float, int, int, int, int], ...]]:
    """Per split projection whose every forward matmul is its weight's plain product, the matmul
    table of one rank's share (``ModuleInfo.matmuls`` rows), its output tiles at the batch the view
    runs (``batch_scale`` x the traced one). See [Note: split matmuls]."""
    weights = {f.rsplit(".", 1)[0]: s for f, s, _d in graph.param_shapes if f.endswith(".weight") and len(s) == 2}
    out = {}
    for fqn, role in roles.items():
        if role not in ("colwise", "rowwise", "head") or fqn not in weights or not graph.info(fqn).matmuls:
            continue
        n, k = (int(d) for d in weights[fqn])  # nn.Linear: (out_features, in_features)
        rows = []
        for f, elements, esize, tiles, calls in graph.info(fqn).matmuls:
            m = round(f / (2.0 * n * k))
            if m < 1 or 2 * m * n * k != round(f) or elements != m * k + k * n + m * n:
                break  # not the plain product (an addmm's bias, a batched call): linear scaling
            k1, n1 = (k // size, n) if role == "rowwise" else (k, n // size)
            big = max(1, round(m * batch_scale))
            rows.append((f / size, m * k1 + k1 * n1 + m * n1, esize,
                         math.ceil(big / TILE) * math.ceil(n1 / TILE) if tiles else 0, calls))
        else:
            out[fqn] = tuple(rows)
    return out


def _collectives(m: ModuleInfo, role: str | None, spec: TPSpec, coll: Callable[[str, float], float], scale: float,
                 blocks: frozenset[str]) -> list[float]:
    """[forward, backward] seconds of the tensor-parallel collectives ``m`` issues in its role
    (``scale``: bytes per traced activation byte as the step runs). See [Note: tensor parallel
    costs] and [Note: sequence parallel costs]."""
    sp, c = spec.sequence_parallel, [0.0, 0.0]
    whole_in, whole_out = m.input_bytes * scale, m.output_bytes * scale
    if sp and (role in ("region", "head") or (role == "colwise" and m.parent in blocks)):
        c[0] += m.num_calls * coll("all_gather", whole_in)  # the sequence shards gathered in (a projection
        c[1] += m.num_calls * coll("reduce_scatter", whole_in)  # with no module around it: itself)
    elif sp and role in ("rowwise", "vocab"):  # partial outputs reduce-scattered onto the sequence shards
        c[0] += m.num_calls * coll("reduce_scatter", whole_out)
        c[1] += m.num_calls * coll("all_gather", whole_out)
    elif role == "rowwise":  # the partial outputs are summed
        c[0] += m.num_calls * coll("all_reduce", whole_out)
    elif role in ("colwise", "head") and not sp:  # the replicated input's partial gradients are summed
        c[1] += m.num_calls * coll("all_reduce", whole_in)  # (sequence parallel: by the region's reduce-scatter)
    if role == "sequence" and m.own_numel:  # a norm's weight: its gradient is a partial sum per rank
        c[1] += coll("all_reduce", m.own_bytes)
    if role == "head" and not spec.loss_parallel:  # the logits gathered whole
        c[0] += m.num_calls * coll("all_gather", whole_out)
    return c


def _overlap(graph: ModelGraph, roles: dict[str, str], base: dict[str, list[float]],
             comm: dict[str, list[float]], size: int, scale: float, op_bw: float | None) -> None:
    """Async tensor parallelism: each sequence-parallel collective micro-pipelined with the matmuls
    it feeds or follows, in ``size`` chunks: what is left exposed of a collective ``c`` beside
    matmuls ``m`` is ``max(c - m, 0) + min(c, m) / size`` (the first chunk's), plus the fused op's
    own memory pass (``scale``: bytes per traced activation byte as the step runs; ``op_bw``: the
    memory-bound ops' bandwidth). See [Note: async tensor parallel]."""
    def exposed(c: float, m: float) -> float:
        return max(c - m, 0.0) + min(c, m) / size

    def gather(nbytes: float) -> float:  # the local shard copied into the symmetric buffer: read and written
        return 2 * nbytes * scale / size / op_bw if op_bw else 0.0

    def scatter(nbytes: float) -> float:  # the stacked partials summed: the whole read, 1/tp written
        return nbytes * scale * (1 + 1 / size) / op_bw if op_bw else 0.0

    for fqn, role in roles.items():
        if fqn not in comm:
            continue
        m = graph.info(fqn)
        if role in ("region",):
            kids = [k for k, r in roles.items() if r == "colwise" and k.rsplit(".", 1)[0] == fqn and k in base]
            mf = sum(base[k][0] for k in kids)
            # backward: the input gradients; the reduce-scatter of their sum (an add: no matmul makes
            # it) is fused with none: See [Note: async tensor parallel]
            mb = base[kids[0]][1] / 2 if len(kids) == 1 else 0.0
            fused = (gather(m.input_bytes), scatter(m.input_bytes) if mb else 0.0)
        elif role == "rowwise":
            mf, mb = base[fqn][0], base[fqn][1] / 2
            fused = (scatter(m.output_bytes), gather(m.output_bytes))
        elif role == "head":
            mf, mb = base[fqn][0], base[fqn][1] / 2
            fused = (gather(m.input_bytes), scatter(m.input_bytes))
        else:
            continue
        comm[fqn] = [exposed(comm[fqn][0], mf) + m.num_calls * fused[0],
                     exposed(comm[fqn][1], mb) + m.num_calls * fused[1]]


def async_tp_support(compute: ComputeProfile, fabric: FabricProfile) -> str | None:
    """None where async tensor parallelism runs (a stated GPU whose node is NVLink 4: torch's
    symmetric-memory micro-pipelining, H100 / H200 SXM), else why not. See [Note: async tensor
    parallel]."""
    if compute.kind != "analytical" or fabric.kind != "analytical":
        return f"async tensor parallelism runs on NVLink GPUs only; this profile is a measured {compute.device}"
    if "NVLink 4" not in fabric.intra.source:
        return f"async tensor parallelism needs NVLink 4 (H100 / H200 SXM) inside the node; {compute.device} has not"
    return None


def with_async(spec: TPSpec | None, asked: bool | str, compute: ComputeProfile, fabric: FabricProfile,
               ) -> tuple[TPSpec | None, str | None]:
    """``spec`` with async tensor parallelism as asked ("auto": where ``async_tp_support`` says it
    runs and sequence parallelism is on), and a note when auto leaves it off or it cannot run."""
    if spec is None:
        return None, None
    why = async_tp_support(compute, fabric)
    if not spec.sequence_parallel:
        why = "async tensor parallelism overlaps sequence parallelism's collectives, which are off"
    if asked == "auto":
        return replace(spec, async_tp=why is None), (f"--async-tp auto: off: {why}" if why else None)
    if asked and why:
        return replace(spec, async_tp=True), f"--async-tp: priced as asked, but {why}"
    return replace(spec, async_tp=bool(asked) and spec.sequence_parallel), None
