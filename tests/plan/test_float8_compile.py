"""One process: which linears float8 converts (TorchTitan's filter), and a block whose graph
breaks under ``fullgraph`` falling back to eager, named (dynamo's "eager" backend: no inductor)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.nn as nn

from wrapopt.models import zoo
from wrapopt.plan.compile import compile_blocks, compile_report

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="float8 needs torchao: pip install 'wrapopt[float8]'")


class _Odd(nn.Module):
    """A head of a vocabulary, a small layer, an indivisible one and a converted one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(96, 32)
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 40)  # 40 % 16 != 0
        self.output_proj = nn.Linear(40, 32)  # named like TorchTitan's filter ("output")
        self.head = nn.Linear(32, 96)  # the last linear, out-features the vocabulary

    def forward(self, x):
        return self.head(self.output_proj(self.odd(self.up(self.emb(x)))))


@needs_torchao
def test_filter_converts_divisible_linears_and_skips_the_head():
    from wrapopt.plan.float8 import convert_float8, float8_filter

    keep, skip = float8_filter(_Odd())
    assert keep == ["up"]
    assert skip["odd"].endswith("not multiples of 16") and "40" in skip["odd"]
    assert "filter_fqns" in skip["output_proj"] and skip["head"] == "the output head"
    keep, skip = float8_filter(_Odd(), small="tensorwise")  # torchao's thresholds, as the simulator prices
    assert keep == [] and "too small to gain from float8 tensorwise" in skip["up"]
    big = nn.Sequential(nn.Linear(4096, 2048), nn.Linear(2048, 1024))  # K 4096 N 2048 gains; K 2048 N 1024 not
    assert float8_filter(big, small="tensorwise")[0] == ["0"]
    assert float8_filter(big, small="rowwise")[0] == []  # rowwise: N <= 2048 is small
    # llama-tiny: every linear of the blocks (dims 32..176, multiples of 16), not lm_head
    model = zoo.get_entry("llama-tiny").build("cpu", seed=0)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        done = convert_float8(model, "rowwise")
    assert done.emulate and any("emulates" in str(w.message) and "small ones too" in str(w.message) for w in seen)
    assert set(done.converted) == set(linears) - {"lm_head"} and done.skipped == {"lm_head": "the output head"}
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert kinds["lm_head"] == "Linear" and kinds["layers.0.mlp.down_proj"] == "Float8Linear"
    x = zoo.get_entry("llama-tiny").inputs()
    zoo.get_entry("llama-tiny").loss(model(*x), x).backward()  # the emulated float8 trains
    assert model.layers[0].mlp.down_proj.weight.grad is not None
    # gpt-tiny's head is tied to the embedding: skipped under its own name
    gpt = zoo.get_entry("gpt-tiny").build("cpu", seed=0)
    assert float8_filter(gpt)[1]["lm_head"] == "the output head"


class _Chatty(nn.Module):
    """A block whose graph breaks: a data-dependent branch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent: fullgraph refuses it
            return y * 2
        return y


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


def test_a_block_that_breaks_the_graph_runs_eager_named():
    torch.manual_seed(0)
    model = nn.Sequential(_Plain(), _Chatty(), _Plain())
    x = torch.randn(4, 8)
    want = model(x)
    report = compile_blocks(model, ["0", "1", "2"], backend="eager")
    assert report["compiled"] == ["0", "1", "2"]
    with pytest.warns(UserWarning, match=r"1 \(_Chatty\) cannot be compiled whole \(fullgraph\): .+; it runs eager"):
        got = model(x)
    torch.testing.assert_close(got, want)
    rep = compile_report(model)
    assert rep["compiled"] == ["0", "2"] and list(rep["eager"]) == ["1"]
    assert "data" in rep["eager"]["1"].lower() or "branch" in rep["eager"]["1"].lower(), rep["eager"]["1"]
    assert model[1].forward.__func__ is _Chatty.forward and model[0].forward.__name__ == "forward"
    assert getattr(model[0].forward, "__func__", None) is not _Plain.forward  # still the compiled one
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the block stays eager
        got.sum().backward()
        model(x)
    assert compile_report(nn.Linear(2, 2)) is None
