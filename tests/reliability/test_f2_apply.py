"""Bad input to float8 and per-block compile as plan.apply applies them (issue #52): one line each,
naming the GPU, the field, the module and what to do."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.plan.apply import check_float8, throughput_knobs, warn_pipeline_knobs
from wrapopt.plan.compile import compile_blocks, compile_report
from wrapopt.train import TrainConfig

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="float8 needs torchao: pip install 'wrapopt[float8]'")


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64))


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_on_a_gpu_without_fp8_tensor_cores_names_it(monkeypatch, recipe):
    from wrapopt.plan.float8 import convert_float8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    knobs = throughput_knobs(TrainConfig(float8=recipe))
    for call in (lambda: check_float8(knobs, "cuda"), lambda: convert_float8(_model(), recipe, device_type="cuda")):
        with pytest.raises(PlanError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "NVIDIA A100-SXM4-80GB" in msg and "8.0" in msg
        assert f"float8 {recipe}" in msg and "FP8 tensor cores" in msg and "--float8 none" in msg
    model = _model()
    with pytest.raises(PlanError):
        convert_float8(model, recipe, device_type="cuda")
    assert [type(m).__name__ for m in model] == ["Embedding", "Linear", "Linear"]  # refused before any swap


@needs_torchao
def test_float8_all_gather_takes_tensorwise_scales():
    from wrapopt.plan.float8 import convert_float8

    with pytest.raises(PlanError, match=r"takes tensorwise scales, not rowwise: use --float8 tensorwise, or drop "
                                        r"--float8-all-gather"):
        convert_float8(_model(), "rowwise", all_gather=True)
    knobs = {"compile": False, "float8": "rowwise", "float8_all_gather": True}
    with pytest.raises(PlanError, match=r"train.float8_all_gather"):
        check_float8(knobs, "cpu")
    with pytest.raises(PlanError, match=r"unknown float8 recipe 'fp8'.*accepted: tensorwise, rowwise"):
        convert_float8(_model(), "fp8")


def test_float8_all_gather_without_float8_is_refused_naming_the_flag():
    with pytest.raises((PlanError, ValueError), match=r"--float8\b"):
        TrainConfig(float8_all_gather=True)


def test_torchao_missing_is_one_line_naming_the_extra(monkeypatch):
    from wrapopt.plan.float8 import convert_float8, torchao_missing

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    why = torchao_missing()
    assert why is not None and "\n" not in why and "pip install 'wrapopt[float8]'" in why
    with pytest.raises(PlanError, match=r"wrapopt\[float8\]"):
        convert_float8(_model(), "tensorwise")
    with pytest.raises(PlanError, match=r"wrapopt\[float8\]"):
        check_float8(throughput_knobs(TrainConfig(float8="tensorwise")), "cpu")


class _Printing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        print("activations", y.shape)  # a side effect dynamo cannot put in one graph
        return y


def test_a_block_that_prints_runs_eager_and_says_which(capsys):
    model = nn.Sequential(nn.Linear(4, 4), _Printing())
    compile_blocks(model, ["1"], backend="eager")
    with pytest.warns(UserWarning, match=r"^wrapopt: 1 \(_Printing\) cannot be compiled whole \(fullgraph\): "):
        model(torch.randn(2, 4))
    assert capsys.readouterr().out.count("activations") == 1  # ran once, eager, after the trace was refused
    rep = compile_report(model)
    assert rep["compiled"] == [] and "print" in rep["eager"]["1"], rep
    assert throughput_knobs(None) == {"compile": False, "float8": "none", "float8_all_gather": False}


def test_a_pipeline_plan_with_the_knobs_says_they_are_not_applied():
    with pytest.warns(UserWarning, match=r"scored with compile and float8 rowwise, which apply_pipeline does not"):
        warn_pipeline_knobs(TrainConfig(compile=True, float8="rowwise"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_pipeline_knobs(TrainConfig())
