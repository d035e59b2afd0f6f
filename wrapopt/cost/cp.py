"""The context-parallel view of a model: one cp rank's share of each sequence, as a ``ComputeProfile``
(and a graph) the FSDP simulator scores on the flattened ``dp_shard x cp`` mesh.

[Note: context parallel costs] Under context parallelism (torch's ``context_parallel``, as TorchTitan
runs it: See [Note: the cp and ep axes of the mesh] in spec/plan.py) each sequence of a data-parallel
rank is split over the ``cp`` ranks of its group, in ``2 x cp`` chunks: rank r holds chunks r and
2cp-1-r (the head-tail load balancer), so under a causal mask every rank does the same share of the
attention. What one rank does is then what a 1-D rank does at ``1/cp`` of the batch:

- every token-proportional figure (the projections' FLOPs, the memory-bound ops, the activations
  saved, the outputs) is ``1/cp`` of the sequence's;
- attention: the rank's queries (``S/cp``) against every key (``S``), balanced: ``1/cp`` of the
  sequence's attention FLOPs, the same share;
- parameters, their gradients and optimizer state are replicated over cp and sharded by FSDP over
  ``dp_shard x cp`` (the plan's shard group counts the cp ranks), so FSDP's collectives are scored
  on that group unchanged.

So the view is the model at ``batch_scale / cp`` (``SimOptions.batch_scale``: sequences per rank),
plus what ring attention adds, per call of each module that runs SDPA (``attention_flops``), on a
group of ``cp`` ranks (``tp`` apart: inside a node while ``cp x tp`` fits one):

- forward: K and V of the rank's chunks all-gathered over the cp group (TorchTitan's default rotate
  method, ``allgather``: one all-gather of the whole sequence's K and V, issued before the local
  chunk's attention and waited after it), exposed as ``max(0, t_allgather - attention / cp)``;
- backward: the same all-gather again, and the gradients of K and V rotated around the ring in
  float32 (torch's ``convert_to_f32``): ``cp`` point-to-point exchanges of the rank's K and V
  gradients, each but the last beside one step's attention backward (``attention_bwd / cp``), the
  last exposed;
- the merges of each step's partial outputs (out and log-sum-exp, float32) and of the gradients:
  memory-bound, about ``3`` float32 passes over the rank's output per step forward and ``6`` over
  its q, k and v gradients backward, over the op bandwidth;
- memory: the gathered K and V of the whole sequence live while a module's attention runs (its
  working set: added to the module's output bytes in the view).

A checkpointed block recomputes its forward, all-gather included, as the simulator charges any
recomputed module. K and V are sized as the tracer saw the attention kernel read them
(``ModuleInfo.attention_kv_elements``): repeated to the queries' heads where the model repeats them
(TorchTitan's Llama at the Table 2 rows' date), at the keys' own heads under ``enable_gqa``
(Hugging Face's SDPA path without a mask, TorchTitan's Llama today): ``H / H_kv`` fewer bytes, as
torch's ring attention exchanges them. Left out: the all-to-all rotate method, the
exchange's contention with FSDP's collectives, and the chunk split of the first and last
positions' RoPE buffers (their size is a position's, per rank).
"""

from __future__ import annotations

from dataclasses import replace

from wrapopt.cost.calls import module_time
from wrapopt.cost.dtypes import traced_dtype_bytes
from wrapopt.cost.roofline import kernel_times
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.spec import ModelGraph, ModuleInfo
from wrapopt.spec.cp import attention_modules, cp_degrees, cp_refusal

__all__ = ["attention_modules", "cp_degrees", "cp_refusal", "cp_view", "kv_bytes"]

_F32 = 4  # bytes: ring attention's merges and gradient rotation run in float32 (convert_to_f32)


def kv_bytes(m: ModuleInfo, seq: int, elem: float) -> float:
    """Bytes of K and V (together) of one call's whole sequences at the traced batch, as its attention
    kernels read them (a graph traced without them: from the attention FLOPs torch counts, ``4 B H S^2 D``
    per call, heads repeated). See [Note: context parallel costs]."""
    if not seq or not m.num_calls:
        return 0.0
    if m.attention_kv_elements:
        return m.attention_kv_elements / m.num_calls * elem
    return 2.0 * m.attention_flops / m.num_calls / (4.0 * seq) * elem


def cp_view(graph: ModelGraph, traced: ModelGraph, compute: ComputeProfile, fabric: FabricProfile, size: int, *,
            group_per_node: int, batch_scale: float, elem: float,
            ) -> tuple[ModelGraph, ComputeProfile, frozenset[str]]:
    """One cp rank's compute profile (per-module times with ring attention's exchanges, at
    ``batch_scale``: the view's sequences per rank, the plan's over ``size``) and its graph:
    ``traced`` with each attention module's working set grown by the gathered K and V; and the
    caveats. ``graph`` and ``compute`` are as the parent simulator prices them (compute dtype and
    knobs applied), ``traced`` as traced; ``group_per_node``: ranks of one cp group on a node;
    ``elem``: bytes per activation element as the step runs. See [Note: context parallel costs]."""
    notes: set[str] = set()

    def coll(kind: str, group: int, per_node: int, nbytes: float) -> float:
        t, caveat = fabric.collective_s(kind, group, per_node, nbytes)
        if caveat:
            notes.add(caveat)
        return t

    measured = {fqn: (f, b) for fqn, f, b in compute.module_times}
    op_bw = compute.op_bandwidth_bytes_per_s
    seq, whole = graph.seq_len, batch_scale * size  # the sequences one cp group runs, per micro-batch
    times, modules = [], {}
    for m in graph.call_order():
        f, b = module_time(m, compute, batch_scale, measured)
        kv = kv_bytes(m, seq, elem) if m.attention_flops else 0.0
        if kv:
            calls = m.num_calls
            af, ab = _attention_s(m, compute, batch_scale, f, b, measured)
            gather = coll("all_gather", size, group_per_node, kv * whole)  # the whole sequence's K and V
            local_f32 = kv * whole / size * _F32 / elem  # this rank's K and V gradients, float32
            p2p = coll("all_gather", 2, min(2, group_per_node), 2 * local_f32)  # one send / receive of it
            step_f, step_b = af / calls / size, ab / calls / size  # one ring step's attention
            f += calls * max(0.0, gather - step_f)
            b += calls * (max(0.0, gather - step_b) + (size - 1) * max(0.0, p2p - step_b) + p2p)
            if op_bw:  # the merges, float32: See [Note: context parallel costs]
                out_f32 = kv * whole / size / 2 * _F32 / elem  # this rank's output (q's size), float32
                f += calls * size * 3 * out_f32 / op_bw
                b += calls * size * 6 * out_f32 / op_bw
            t = traced.info(m.fqn)  # its working set, in the traced dtype (the view rescales it as the parent)
            modules[m.fqn] = replace(t, output_bytes=int(t.output_bytes + kv_bytes(t, seq, _elem(traced)) * size))
        times.append((m.fqn, f / batch_scale, b / batch_scale))
    if not modules:
        notes.add("context parallelism: no module runs scaled_dot_product_attention; nothing is exchanged")
    tree = traced.tree.copy()
    for fqn, m in modules.items():
        tree.nodes[fqn]["info"] = m
    view = replace(traced, modules=tuple(modules.get(m.fqn, m) for m in traced.modules), tree=tree)
    # the times are at batch_scale already (module_time): See [Note: batch scaling] in calls.py
    return view, replace(compute, module_times=tuple(times), batch_fixed_share=0.0), frozenset(notes)


def _elem(graph: ModelGraph) -> float:
    """Bytes per activation element of the graph as traced."""
    return float(traced_dtype_bytes(graph))


def _attention_s(m: ModuleInfo, compute: ComputeProfile, scale: float, f: float, b: float,
                 measured: dict) -> tuple[float, float]:
    """(forward, backward) seconds of ``m``'s attention kernels over its calls at batch ``scale``:
    the kernel roofline's attention class on a stated GPU, else its share of the FLOPs."""
    if compute.matmul_flops_per_s and not measured:
        af, ab = kernel_times(m, compute).get("attention", (0.0, 0.0))
        return af * scale, ab * scale
    share = m.attention_flops / m.fwd_flops if m.fwd_flops else 1.0
    return f * min(1.0, share), b * min(1.0, share)
