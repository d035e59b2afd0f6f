"""measure_split.py (split efficiency, tensor-parallel overhead) and measure_checkpoint_overhead with a model cache."""

from __future__ import annotations

import math

import pytest
import torch

from wrapopt import zoo
from wrapopt.hardware.measure_device import measure_checkpoint_overhead
from wrapopt.hardware.measure_device import measure_compute
from wrapopt.hardware.measure_split import measure_split_efficiency, measure_tp_overhead, with_tp_measurements
from wrapopt.launch import spawn
from wrapopt.tp import builtin_tp_plan
from wrapopt.trace import trace_model


def _llama_tiny_plan():
    model, x = zoo.build("llama-tiny", "meta")
    g = trace_model(model, x)
    return g, builtin_tp_plan(g)


def test_split_efficiency_per_degree_that_divides():
    # A synthetic timer (no wall time): a FLOP term plus a per-call cost that grows with the rows,
    # so a split (d times the rows, 1/d of the features: the same FLOPs) runs slower.
    g, spec = _llama_tiny_plan()
    calls = []

    def timer(rows: int, fin: int, fout: int) -> float:
        calls.append((rows, fin, fout))
        return 2e-9 * rows * fin * fout + 1e-6 * rows

    eff = dict(measure_split_efficiency(g, spec, (1, 2, 3), timer=timer))
    # 1 is not a split; 3 divides no projection of width 64; 2 is measured
    assert set(eff) == {2}
    whole, split = calls[::2], calls[1::2]  # interleaved: each whole timing, then its split
    # each projection shape timed three times whole and three times split two ways (d times the rows,
    # 1/d of the split features: the same FLOPs)
    assert whole and len(whole) % 3 == 0 and all(whole[i] == whole[i - i % 3] for i in range(len(whole)))
    assert all(r2 == 2 * r and r * i * o == r2 * i2 * o2 for (r, i, o), (r2, i2, o2) in zip(whole, split))
    assert 0 < eff[2] < 1  # the same FLOPs and twice the per-row cost: the split runs slower


def test_split_efficiency_is_the_weighted_ratio_of_the_timer_figures():
    g, spec = _llama_tiny_plan()
    flat = dict(measure_split_efficiency(g, spec, (2,), timer=lambda rows, fin, fout: 1.0))
    assert flat == {2: 1.0}  # as fast split as whole: efficiency 1
    halved = dict(measure_split_efficiency(g, spec, (2,), timer=lambda rows, fin, fout: 1.0 / rows))
    assert halved[2] == pytest.approx(2.0)  # every split shape (2x the rows) timed at half: twice as efficient
    # the timer's medians of three: one outlier per shape does not move the result
    seen: dict = {}

    def noisy(rows: int, fin: int, fout: int) -> float:
        seen[(rows, fin, fout)] = seen.get((rows, fin, fout), 0) + 1
        return 100.0 if seen[(rows, fin, fout)] == 1 else 1.0

    assert dict(measure_split_efficiency(g, spec, (2,), timer=noisy)) == {2: 1.0}


def test_split_efficiency_default_timer_runs_on_the_cpu():
    g, spec = _llama_tiny_plan()
    (degree, eff), = measure_split_efficiency(g, spec, (2,), repeats=1)
    assert degree == 2 and math.isfinite(eff) and eff > 0  # a figure, whatever this machine's speed


class _CacheBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is not None:
            past_key_values.append(x)  # as a Hugging Face cache grows
        return self.lin(x)


class _CacheModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_CacheBlock() for _ in range(2))
        self.cache = []

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, past_key_values=self.cache, use_cache=True)
        return x


def test_checkpoint_overhead_runs_blocks_without_the_model_cache():
    model = _CacheModel()
    overhead, forward = measure_checkpoint_overhead(model, (torch.randn(4, 8),), repeats=1)
    assert 0 <= forward <= overhead
    assert len(model.cache) == 2  # the one forward that captured the inputs; the timed calls added nothing


def _tp_worker(rank, world, _):
    """Both spawned measurements in one spawn of 2 ranks (a spawn costs seconds): measure_tp_overhead
    alone, then with_tp_measurements filling a compute profile."""
    torch.set_num_threads(1)
    overhead = measure_tp_overhead(2, repeats=1)
    model, x = zoo.build("llama-tiny", "meta")
    g = trace_model(model, x)
    base = measure_compute(device="cpu", repeats=1, unit_overhead_s=0.0)
    out = with_tp_measurements(base, g, (2, 4))  # 4 does not divide the world of 2: 2 alone is measured
    return {"overhead": overhead, "eff": [list(e) for e in out.split_efficiency], "oh": list(out.tp_overhead_s)}


@pytest.fixture(scope="module")
def tp_results():
    return spawn(_tp_worker, world_size=2, args=(None,), timeout_s=180)


@pytest.mark.multiprocess
def test_tp_overhead_is_measured_on_every_rank_alike(tp_results):
    out = [r["overhead"] for r in tp_results]
    assert out[0] == out[1]  # the max over ranks, on every rank
    fwd, bwd = out[0]
    assert fwd >= 0 and bwd >= 0 and math.isfinite(fwd + bwd)  # floored at 0; no speed is asserted


@pytest.mark.multiprocess
def test_with_tp_measurements_fills_the_compute_profile(tp_results):
    out = tp_results
    assert [d for d, _ in out[0]["eff"]] == [2]
    assert out[0]["oh"] == out[1]["oh"] and min(out[0]["oh"]) >= 0
