"""The context-parallel view (cost/cp.py): one cp rank's share of each sequence and ring attention's
exchanges, scored through ``Simulator.simulate`` of a plan with ``cp_size``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from wrapopt.cost.cp import attention_modules, cp_degrees, cp_refusal, kv_bytes
from wrapopt.cost.simulate import Simulator
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec, Shape
from wrapopt.trace.meta import trace_model

MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


@pytest.fixture(scope="module")
def sim(llama_tiny):
    return Simulator(llama_tiny[2], analytical_fabric(world_size=8), analytical_compute())


def test_kv_is_sized_as_the_attention_kernel_reads_it(llama_tiny):
    graph = llama_tiny[2]
    attn = attention_modules(graph)
    assert len(attn) == len(graph.blocks)  # one SDPA per block, in the attention module
    m = attn[0]
    q = graph.info(f"{m.fqn}.q_proj")  # K and V as SDPA receives them: the queries' heads (MHA here)
    assert kv_bytes(m, graph.seq_len, 4) == pytest.approx(2 * q.output_bytes, rel=1e-9)
    # a graph traced without the K and V sizes: the same, from the attention FLOPs (heads repeated)
    assert kv_bytes(replace(m, attention_kv_elements=0.0), graph.seq_len, 4) == pytest.approx(2 * q.output_bytes)
    assert cp_refusal(graph) is None


class _GroupedAttention(nn.Module):
    """Causal SDPA with 4 query heads over 1 key/value head: grouped (``enable_gqa``) or repeated."""

    def __init__(self, grouped: bool, dim: int = 32, heads: int = 4, kv_heads: int = 1):
        super().__init__()
        self.grouped, self.heads, self.kv_heads, self.hd = grouped, heads, kv_heads, dim // heads
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * kv_heads * self.hd)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        if not self.grouped:
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


def test_grouped_keys_are_exchanged_at_their_own_heads():
    """With enable_gqa the kernel reads K and V at the keys' heads, and context parallelism gathers
    them so: a quarter of the bytes of the same attention with the heads repeated (4 over 1)."""
    x = torch.randn(2, 64, 32, device="meta")
    sizes = {}
    for grouped in (True, False):
        graph = trace_model(nn.Sequential(_GroupedAttention(grouped)).to("meta"), (x,),
                            loss_fn=lambda out, _inputs: out.float().pow(2).mean())
        m = attention_modules(graph)[0]
        sizes[grouped] = kv_bytes(m, 64, 4)
    assert sizes[True] == pytest.approx(2 * 2 * 64 * 1 * 8 * 4)  # K and V: B x S x H_kv x D, float32
    assert sizes[False] == pytest.approx(4 * sizes[True])


def test_a_cp_rank_holds_its_share_of_the_activations(sim, llama_tiny):
    plan = baselines(llama_tiny[2], MESH)["per-block"]
    whole = sim.simulate(plan)
    base = dict(whole.peak_breakdown)
    assert base["activations"] > 0
    for cp in (2, 4):
        est = sim.simulate(replace(plan, mesh=MESH.with_cp(cp)))
        parts = dict(est.peak_breakdown)
        assert parts["activations"] == pytest.approx(base["activations"] / cp, rel=0.02)
        # parameters and optimizer state: FSDP over dp_shard x cp, as without cp
        for part in ("sharded_params", "optimizer_state"):
            assert parts[part] == pytest.approx(base[part], rel=1e-6)
        assert est.peak_bytes < whole.peak_bytes


def test_the_exchange_is_the_allgather_left_after_the_local_chunk(llama_tiny):
    """On a link a thousand times slower, the exposed forward exchange of an attention module is its
    calls x the all-gather of the whole sequence's K and V on the cp group, less one ring step."""
    graph = llama_tiny[2]
    fast = analytical_fabric(world_size=8)
    slow = replace(fast, intra=replace(fast.intra, bandwidth_bytes_per_s=fast.intra.bandwidth_bytes_per_s / 1000),
                   _cache={})
    fwd = {}
    for name, fab in (("fast", fast), ("slow", slow)):
        s = Simulator(graph, fab, analytical_compute())
        view = s.for_cp(2, 2)[0]
        fwd[name] = dict((f, t) for f, t, _b in view.compute.module_times)
    m = attention_modules(graph)[0]
    elem = 4.0  # float32 activations: the trace's and the step's dtype here
    gather, _ = slow.collective_s("all_gather", 2, 2, kv_bytes(m, graph.seq_len, elem))  # batch_scale 1/2 x cp 2
    added = (fwd["slow"][m.fqn] - fwd["fast"][m.fqn]) * 0.5  # the view's times are per unit of its scale
    assert added == pytest.approx(m.num_calls * gather, rel=0.05)
    other = graph.info(f"{m.fqn}.q_proj").fqn  # a projection exchanges nothing
    assert fwd["slow"][other] == pytest.approx(fwd["fast"][other])


def test_the_view_is_the_shape_view_and_refuses_a_pipeline(sim, llama_tiny):
    assert sim.view(Shape(cp=2)) is sim.for_cp(2, 2)[0]
    assert sim.for_cp(2, 2)[0].options.batch_scale == pytest.approx(sim.options.batch_scale / 2)


def test_cp_degrees_split_the_sequence_in_2_x_cp_chunks():
    assert cp_degrees(64, 8) == (2, 4, 8)
    assert cp_degrees(96, 16) == (2, 4, 8, 16)
    assert cp_degrees(100, 8) == (2,)  # 100 = 2 x 2 x 25: only 2 x 2 chunks
    assert cp_degrees(64, 6) == (2,)


def test_a_model_without_a_sequence_is_refused():
    from wrapopt.models import zoo
    from wrapopt.trace.meta import trace_model

    model, x = zoo.build("vit-tiny", "meta")
    assert "no sequence dimension" in cp_refusal(trace_model(model, x))


def test_attention_without_is_causal_is_refused_naming_the_module():
    from wrapopt.models import zoo
    from wrapopt.trace.meta import trace_model

    model, x = zoo.build("tx-encoder", "meta")
    why = cp_refusal(trace_model(model, x))
    assert why.startswith("encoder.layers.0.self_attn (MultiheadAttention) runs attention without is_causal=True")
