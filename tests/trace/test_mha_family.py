"""The held-out family of issue 51 (zoo:mha-tied: user blocks around ``nn.MultiheadAttention``, the
head tied to the embedding) as the tracer sees it."""

from __future__ import annotations

import pytest

from wrapopt import trace_model, zoo


@pytest.fixture(scope="module")
def traced():
    e = zoo.get_entry("mha-tied")
    model = e.build("meta")
    return model, trace_model(model, e.inputs(), loss_fn=e.loss, fx=False)


def test_blocks_form_one_chain_and_out_proj_is_read_by_its_attention(traced):
    _model, graph = traced
    assert [len(c) for c in graph.block_chains] == [8]
    users = dict(graph.param_users)
    assert all(users[f"blocks.{i}.attn.out_proj"] == f"blocks.{i}.attn" for i in range(8))
    assert graph.info("blocks.0.attn.out_proj").num_calls == 0  # F.multi_head_attention_forward reads its weight


def test_tied_head_is_counted_once_and_attention_saves_no_seq_by_seq_matrix(traced):
    model, graph = traced
    assert model.lm_head.weight is model.wte.weight
    assert graph.root.total_numel == sum(p.numel() for p in model.parameters())  # parameters() de-duplicates
    # the fused kernel saves its input, q, k, v, the output (each batch x seq x dim) and the log-sum-exp
    # (batch x heads x seq): no (batch, heads, seq, seq) matrix of the math path, which would add as much again
    e = zoo.get_entry("mha-tied")
    batch, seq = e.inputs()[0].shape
    dim, heads = model.wte.embedding_dim, model.blocks[0].attn.num_heads
    assert graph.info("blocks.0.attn").saved_bytes <= 4 * (5 * batch * seq * dim + batch * heads * seq)
