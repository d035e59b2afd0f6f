"""The tracer on meta models that read their inputs' values, and grouped-matmul experts
(See [Note: integer inputs stay real] in trace/meta.py, [Note: experts on meta] in trace/ops.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from wrapopt.errors import TraceError
from wrapopt.trace.meta import trace_model


class _Reads(nn.Module):
    """Asks ``.item()`` about a mask it builds from its integer input, then moves it to
    its own device, as Hugging Face's mask helpers do."""

    def __init__(self, check: bool):
        super().__init__()
        self.check = check
        self.emb = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        if self.check:
            mask = mask.to(x.device, torch.bool)
            if not bool(mask.all()):  # .item() on a value of the inputs
                x = x.masked_fill(~mask[..., None], 0.0)
        return self.proj(x)


def _inputs():
    return torch.randint(0, 50, (2, 6)), torch.ones(2, 6, dtype=torch.long)


def test_a_meta_model_reading_its_integer_inputs_traces_with_them_real():
    with torch.device("meta"):
        reads, plain = _Reads(True), _Reads(False)
    g = trace_model(reads, _inputs(), loss_fn=lambda out, _x: out.sum())
    ref = trace_model(plain, _inputs(), loss_fn=lambda out, _x: out.sum())
    assert any("integer inputs kept real" in e for e in g.estimates)
    assert not any("integer inputs kept real" in e for e in ref.estimates)
    assert all(p.is_meta for p in reads.parameters())  # weights stayed on meta
    for name in ("emb", "proj"):
        assert g.info(name).fwd_flops == ref.info(name).fwd_flops
        assert g.info(name).saved_bytes == ref.info(name).saved_bytes


class _ReadsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x * self.w if bool(self.w.sum() > 0) else x  # a weight's value: meta has none


def test_a_meta_model_reading_its_weights_says_what_to_pass():
    with torch.device("meta"):
        m = _ReadsWeight()
    with pytest.raises(TraceError, match="Pass the value it reads as an input"):
        trace_model(m, (torch.ones(2, 4), torch.ones(2, dtype=torch.long)), loss_fn=lambda out, _x: out.sum())


class _Experts(nn.Module):
    """Tokens sorted by expert, one matrix per expert (Hugging Face's grouped_mm experts)."""

    def __init__(self, n: int, dim: int, hidden: int, k: int):
        super().__init__()
        self.k = k
        self.w = nn.Parameter(torch.randn(n, dim, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.w.shape[0]
        rows = x.repeat_interleave(self.k, dim=0)  # (tokens x k, dim), as if sorted by expert
        offs = torch.linspace(rows.shape[0] / n, rows.shape[0], n, device=x.device).to(torch.int32)
        return F.grouped_mm(rows, self.w, offs=offs)


def test_grouped_matmul_experts_trace_on_meta_in_float32_at_the_routed_share():
    tokens, dim, hidden, n, k = 12, 16, 32, 4, 2
    with torch.device("meta"):
        m = _Experts(n, dim, hidden, k)
    g = trace_model(m, (torch.randn(tokens, dim),), loss_fn=lambda out, _x: out.float().sum())
    info = g.info("")
    assert info.fwd_flops == 2 * tokens * k * dim * hidden  # top-k of n experts per token, not n
    assert info.bwd_flops == pytest.approx(info.fwd_flops)  # the weight gradient (a 2-D by 2-D grouped matmul) only
    assert info.own_numel == n * dim * hidden  # memory holds every expert
    assert info.experts == n  # the stacked weight's leading dimension, recorded from the grouped matmul
