"""The tensor-parallel recogniser and checks (wrapopt/tp.py) and the 2-D mesh."""

from __future__ import annotations

import pytest
import torch.nn as nn

from wrapopt import zoo
from wrapopt.errors import PlanError
from wrapopt.spec import MeshSpec
from wrapopt.tp import TPSpec, builtin_tp_plan, check_tp, tp_degrees
from wrapopt.trace import trace_model


def _graph(name):
    model, x = zoo.build(name, "meta")
    return trace_model(model, x)


def test_llama_and_t5_blocks_are_recognised():
    spec = builtin_tp_plan(_graph("llama-tiny"))
    assert spec.styles("LlamaBlock") == {
        "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
    t5 = builtin_tp_plan(_graph("t5-tiny"))
    assert {c for c, _ in t5.layers} == {"T5EncoderBlock", "T5DecoderBlock"}
    assert t5.styles("T5DecoderBlock")["cross_attn.o_proj"] == "rowwise"


def test_heads_limit_the_degree():
    g = _graph("llama-tiny")  # 4 heads, 2 key-value heads
    spec = builtin_tp_plan(g)
    assert g.attention_heads[0][1:] == (4, 2)
    check_tp(g, spec, 2)
    with pytest.raises(PlanError, match=r"does not divide the heads of layers\.0\.self_attn .*divisor of 2"):
        check_tp(g, spec, 4)
    assert tp_degrees(g, spec, 8, 64) == (1, 2)
    assert tp_degrees(_graph("gpt-tiny"), builtin_tp_plan(_graph("gpt-tiny")), 8, 64) == (1, 2, 4)
    with pytest.raises(PlanError, match="heads"):
        tp_degrees(g, spec, 8, 64, asked=[4])


class _Fused(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.n_heads = 4
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(q * k.sigmoid() + v)


class _Block(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        out = self.attn(x, x, x)[0] if isinstance(self.attn, nn.MultiheadAttention) else self.attn(x)
        return x + out


class _Stack(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(make()) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("make, match", [
    (_Fused, r"attention blocks\.0\.attn .*fused query-key-value .*pass a TPSpec for _Block"),
    (lambda: nn.MultiheadAttention(32, 4, batch_first=True), r"blocks\.0\.attn is an nn\.MultiheadAttention.*--tp 1"),
])
def test_blocks_it_cannot_split_are_named(make, match):
    import torch
    with torch.device("meta"):
        model = _Stack(make)
    g = trace_model(model, (torch.empty(2, 8, 32, device="meta"),),
                    loss_fn=lambda out, inputs: out.float().pow(2).mean())
    with pytest.raises(PlanError, match=match):
        builtin_tp_plan(g)


def test_a_user_plan_is_checked_against_the_model():
    g = _graph("gpt-tiny")
    with pytest.raises(PlanError, match="names block class Nope"):
        check_tp(g, TPSpec(layers=(("Nope", (("a", "colwise"),)),), source="user"), 2)
    with pytest.raises(PlanError, match=r"names attn\.qkv, but layers\.0\.attn\.qkv is not an nn\.Linear"):
        check_tp(g, TPSpec(layers=(("GPTBlock", (("attn.qkv", "colwise"),)),), source="user"), 2)
    with pytest.raises(ValueError, match="unknown style"):
        TPSpec(layers=(("GPTBlock", (("attn.q_proj", "diagonal"),)),))


def test_the_2d_mesh():
    m = MeshSpec(world_size=64, ranks_per_node=8, shard_size=16, tp_size=2)
    assert (m.dp_size, m.replicate_size, m.shape, m.axis_names) == (32, 2, (2, 16, 2), ("replicate", "shard", "tp"))
    dp = m.data_parallel()
    assert (dp.world_size, dp.ranks_per_node, dp.shard_size, dp.tp_size) == (32, 4, 16, 1)
    assert dp.with_tp(2) == m
    assert m.to_json()["tp_size"] == 2 and "tp_size" not in dp.to_json()
    with pytest.raises(ValueError, match="does not divide the 8 ranks per node"):
        MeshSpec(world_size=64, ranks_per_node=8, shard_size=4, tp_size=3)
    with pytest.raises(ValueError, match="data-parallel ranks"):
        MeshSpec(world_size=64, ranks_per_node=8, shard_size=64, tp_size=2)
