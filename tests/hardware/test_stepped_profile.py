"""measure_compute times a model after a few optimizer steps, and gives it back as it was:
See [Note: time a stepped model] in wrapopt/hardware/measure_overheads.py.

Assertions are on the state the timing code sees (denormal weights or gradients), never on wall time.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from wrapopt.hardware import measure_device
from wrapopt.hardware.measure_device import measure_compute, stepped_briefly
from wrapopt.models.bench_models import MHAGPT
from wrapopt.models.entry import lm_loss

TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32; nonzero values below it are denormal


def _denormal_share(t: torch.Tensor) -> float:
    a = t.detach().abs()
    return ((a > 0) & (a < TINY)).float().mean().item()


def _denormal_linear() -> nn.Linear:
    """A Linear whose weights are all denormal (the bias keeps its default init, so the default loss has a
    gradient that AdamW turns into steps of ~lr)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.copy_(torch.sign(torch.randn(4, 4)) * 1e-40)
    assert _denormal_share(lin.weight) == 1.0
    return lin


def test_module_figures_are_timed_on_a_stepped_model_and_the_model_comes_back_unchanged(monkeypatch) -> None:
    lin = _denormal_linear()
    weight, before = lin.weight, {k: v.clone() for k, v in lin.state_dict().items()}
    seen: dict[str, float] = {}
    real_times, real_share = measure_device.measure_module_times, measure_device.measure_batch_fixed_share

    def spy_times(model: nn.Module, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen["module_times"] = _denormal_share(model.weight)
        return real_times(model, *args, **kwargs)

    def spy_share(model: nn.Module, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen["batch_fixed_share"] = _denormal_share(model.weight)
        return real_share(model, *args, **kwargs)

    monkeypatch.setattr(measure_device, "measure_module_times", spy_times)
    monkeypatch.setattr(measure_device, "measure_batch_fixed_share", spy_share)
    prof = measure_compute(model=lin, example_inputs=(torch.randn(4, 4),), repeats=1)
    assert seen == {"module_times": 0.0, "batch_fixed_share": 0.0}  # no denormal weight was timed
    assert "AdamW steps" in prof.meta["model_state"]
    assert lin.weight is weight and lin.weight.grad is None  # the same Parameter, its gradient cleared
    for k, v in lin.state_dict().items():
        assert torch.equal(v, before[k]), k  # bit for bit as given: still denormal


def test_a_model_without_trainable_parameters_or_denormals_is_timed_as_given() -> None:
    lin = _denormal_linear().requires_grad_(False)
    with stepped_briefly(lin, (torch.randn(2, 4),)) as steps:
        assert steps == 0 and _denormal_share(lin.weight) == 1.0
    with stepped_briefly(_denormal_linear(), (torch.randn(2, 4),), max_steps=0) as steps:
        assert steps == 0
    plain = nn.Linear(4, 4)
    before = plain.weight.detach().clone()
    with stepped_briefly(plain, (torch.randn(2, 4),)) as steps:  # nothing denormal: no step taken
        assert steps == 0 and torch.equal(plain.weight, before)


def test_the_steps_draw_from_a_forked_rng() -> None:
    lin = nn.Sequential(nn.Dropout(0.5), _denormal_linear())  # the dropout draws in every step
    torch.manual_seed(7)
    with stepped_briefly(lin, (torch.randn(2, 4),)) as steps:
        assert steps > 0
    after = torch.rand(3)
    torch.manual_seed(7)
    torch.randn(2, 4)
    assert torch.equal(after, torch.rand(3))


def test_a_restore_follows_an_error_inside_the_timing() -> None:
    lin = _denormal_linear()
    before = lin.weight.detach().clone()
    try:
        with stepped_briefly(lin, (torch.randn(2, 4),)):
            assert _denormal_share(lin.weight) == 0.0
            raise RuntimeError("timing failed")
    except RuntimeError:
        pass
    assert torch.equal(lin.weight, before) and lin.weight.grad is None


def test_the_tied_head_of_mha_tied_leaves_denormals_in_the_steps_before_timing() -> None:
    # The bench's mha-tied family at d=128, made small (the tied N(0, 1) embedding and the final LayerNorm make
    # the logits ~100 apart at any vocabulary): fresh, a third of the head's output gradient is denormal.
    torch.manual_seed(0)
    model = MHAGPT(vocab=512, dim=128, n_layers=4, n_heads=4, ffn=128, max_seq=32)
    idx = torch.randint(0, 512, (2, 32))

    def dlogits_denormal_share() -> float:
        out = model(idx)
        out.retain_grad()
        lm_loss(out, (idx,)).backward()
        model.zero_grad(set_to_none=True)
        return _denormal_share(out.grad)

    fresh = dlogits_denormal_share()
    with stepped_briefly(model, (idx,), lm_loss) as steps:
        stepped = dlogits_denormal_share()
    # the stepping stops when no parameter, activation or gradient is 0.1% denormal
    assert fresh > 0.1 and 0 < steps < 24 and stepped < 1e-3, (fresh, steps, stepped)
    assert dlogits_denormal_share() == fresh  # restored: the fresh model again
