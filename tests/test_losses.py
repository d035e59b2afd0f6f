"""A ``loss_fn`` that returns more than one number is refused in one line naming it, the
shape it returned and the fix, wherever wrapopt calls it: the trace (meta and real
weights), ``wrapopt.train_step`` and the device measurement (issue 33)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from wrapopt.errors import ModelError
from wrapopt.hardware.measure_device import measure_loss_time, measure_module_times
from wrapopt.losses import scalar_loss
from wrapopt.plan.step import train_step
from wrapopt.trace.meta import trace_model


def per_example_loss(output, inputs):
    return output.pow(2).mean(dim=-1)  # forgot to reduce over the batch: shape (batch,)


def _model(device: str = "cpu") -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).to(device)


def _check(err: pytest.ExceptionInfo) -> None:
    msg = str(err.value)
    assert "\n" not in msg and "per_example_loss" in msg and "(3,)" in msg and ".mean()" in msg, msg


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_trace_refuses_a_non_scalar_loss(device):
    with pytest.raises(ModelError) as err:
        trace_model(_model(device), (torch.randn(3, 4),), loss_fn=per_example_loss)
    _check(err)


def test_train_step_refuses_a_non_scalar_loss():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ModelError) as err:
        train_step(model, opt, [(torch.randn(3, 4),)], per_example_loss)
    _check(err)


def test_the_device_measurement_refuses_a_non_scalar_loss():
    with pytest.raises(ModelError) as err:
        measure_loss_time(_model(), (torch.randn(3, 4),), per_example_loss, repeats=1)
    _check(err)
    with pytest.raises(ModelError) as err:
        measure_module_times(_model(), (torch.randn(3, 4),), loss_fn=per_example_loss, repeats=1, warmup=0)
    _check(err)


def test_a_scalar_or_one_element_loss_passes_and_other_returns_are_named():
    one = torch.ones(1)
    assert scalar_loss(one, per_example_loss) is one
    with pytest.raises(ModelError, match=r"returned float, not a scalar"):
        scalar_loss(1.5, per_example_loss)
