"""[Note: kernel roofline]: matmuls priced from their shape, attention as the kernel runs it, measured
profiles as before (issue 35)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from wrapopt.cost.calls import module_time
from wrapopt.cost.roofline import kernel_times
from wrapopt.hardware.presets import analytical_compute
from wrapopt.trace.meta import trace_model


class _Attn(nn.Module):
    def __init__(self, d: int, causal: bool):
        super().__init__()
        self.qkv, self.causal = nn.Linear(d, 3 * d), causal

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).transpose(1, 2).reshape(b, s, d)


def _graph(d: int = 64, causal: bool = True, tokens: int = 256):
    model = nn.Sequential(_Attn(d, causal), nn.Linear(d, d)).to("meta")
    return trace_model(model, (torch.zeros(1, tokens, d, device="meta"),), loss_fn=lambda out, _x: out.float().sum())


def test_trace_records_each_matmul_and_attention():
    g = _graph()
    mods = {m.fqn: m for m in g.modules}
    assert sum(f * n for f, _e, _s, _t, n in mods["1"].matmuls) == mods["1"].fwd_flops
    (f, elements, size, tiles, calls), = mods["1"].matmuls
    assert (elements, size, tiles, calls) == (256 * 64 * 2 + 64 * 64, 4, 2, 1)
    att = mods["0"]
    assert att.attention_flops > 0 and att.attention_run_flops == att.attention_flops / 2  # causal: half


def test_causal_attention_costs_half():
    comp = analytical_compute("h100-sxm", dtype="bfloat16")
    causal = {m.fqn: m for m in _graph(causal=True).modules}["0"]
    full = {m.fqn: m for m in _graph(causal=False).modules}["0"]
    assert kernel_times(causal, comp)["attention"][0] == pytest.approx(kernel_times(full, comp)["attention"][0] / 2)
    assert kernel_times(full, comp)["attention"][0] == pytest.approx(full.attention_flops / comp.attention_flops_per_s)


class _Sdpa(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, x):
        b, s, d = x.shape
        q = x.view(b, s, 4, d // 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=self.causal).transpose(1, 2).reshape(b, s, d)


def test_attention_backward_counts_the_fused_kernels_recompute():
    """torch's formula counts four backward matmuls (twice the forward); the fused kernel runs five (it
    recomputes QK^T): 2.5x the forward, causal or not."""
    comp = analytical_compute("h100-sxm", dtype="bfloat16")
    for causal in (True, False):
        model = nn.Sequential(nn.Linear(64, 64), _Sdpa(causal), nn.Linear(64, 64)).to("meta")
        g = trace_model(model, (torch.zeros(1, 256, 64, device="meta"),), loss_fn=lambda out, _x: out.float().sum())
        att = {m.fqn: m for m in g.modules}["1"]
        assert att.fwd_flops == att.attention_flops > 0
        att = dataclasses.replace(att, bwd_flops=2 * att.fwd_flops)  # torch's formula: dS, dV, dQ, dK
        fwd, bwd = kernel_times(att, comp)["attention"]
        assert bwd == pytest.approx(2.5 * fwd)


def test_a_narrow_matmul_pays_its_bytes_and_a_wide_one_barely():
    comp = analytical_compute("a100-80gb-sxm", dtype="bfloat16")
    share = {}
    for d in (64, 4096):
        m = {x.fqn: x for x in _graph(d=d, tokens=4096).modules}["1"]
        (f, elements, _size, tiles, _n), = m.matmuls
        busy = tiles / (108 * -(-tiles // 108))  # d = 4096: 32 x 32 tiles on 108 SMs, 10 waves
        bytes_s = elements * 2 / comp.memory_bandwidth_bytes_per_s  # at the compute dtype, not the traced fp32
        t = kernel_times(m, comp)["GEMM"][0]
        assert t == pytest.approx(f / (comp.matmul_flops_per_s * busy) + bytes_s)
        share[d] = bytes_s / t
    assert share[64] > 0.5 and share[4096] < 0.1  # d = 64: 32 tiles fill 32 of 108 SMs, the rest is bytes


def test_measured_profiles_keep_one_rate():
    g = _graph()
    comp = dataclasses.replace(analytical_compute(), matmul_flops_per_s=0.0, op_bandwidth_bytes_per_s=0.0,
                               module_overhead_s=0.0)
    for m in g.modules:
        assert module_time(m, comp, 1.0, {}) == pytest.approx((m.fwd_flops / comp.flops_per_s,
                                                                m.bwd_flops / comp.flops_per_s))
