"""measure_split_efficiency: the projections a TPSpec splits, timed whole and split."""

from __future__ import annotations

from wrapopt import zoo
import torch

from wrapopt.hardware.measure_device import measure_checkpoint_overhead
from wrapopt.hardware.measure_split import measure_split_efficiency
from wrapopt.tp import builtin_tp_plan
from wrapopt.trace import trace_model


def test_split_efficiency_per_degree_that_divides():
    model, x = zoo.build("llama-tiny", "meta")
    g = trace_model(model, x)
    spec = builtin_tp_plan(g)
    eff = dict(measure_split_efficiency(g, spec, (1, 2, 3), repeats=1))
    # 1 is not a split; 3 divides no projection of width 64; 2 is measured
    assert set(eff) == {2}
    assert 0.05 < eff[2] < 20


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
    overhead = measure_checkpoint_overhead(model, (torch.randn(4, 8),), repeats=1)
    assert overhead >= 0
    assert len(model.cache) == 2  # the one forward that captured the inputs; the timed calls added nothing
