"""The throughput knobs in the search (issue 52, [Note: knob defaults] in wrapopt/search/knobs.py):
compile on by default on a stated GPU and off where it does not apply; float8 searched with
``--float8 auto`` on a GPU with FP8 tensor cores, never on an A100; off by default, with the gain
it would bring named; the choice in the plan file, the report and the TorchTitan export."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from wrapopt import zoo
from wrapopt.api import plan_model
from wrapopt.job import prepare
from wrapopt.report.choice import format_report
from wrapopt.search.driver import SearchOptions
from wrapopt.search.knobs import float8_choices, settle_compile
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.train import TrainConfig

D = 4096  # every linear passes TorchTitan's float8 filter (both recipes' auto filter) at this size
MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(D, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _job(train: TrainConfig, fabric: str = "h100-sxm+ib400", mesh: MeshSpec = MESH):
    with torch.device("meta"):
        model = _Stack()
    x = torch.empty(2, 1024, D, device="meta")
    return prepare(ParallelRequest(mesh=mesh, memory_budget="none", train=train), model, x, fabric=fabric)


@pytest.fixture(scope="module")
def searched():
    """--float8 auto on an H100 and the same job with float8 left off (the default)."""
    auto = _job(TrainConfig.preset("bf16", float8="auto"))
    off = _job(TrainConfig.preset("bf16"))
    return (auto, *plan_model(auto, search=SearchOptions(trials=0))), (off, *plan_model(off, search=SearchOptions(
        trials=0)))


def test_compile_is_on_by_default_on_a_stated_gpu_and_off_where_asked_or_on_cpu_ranks():
    stated = _job(TrainConfig()).compute
    on, why = settle_compile(TrainConfig(), stated)
    assert on.compile is True and why.startswith("compile: on by default on a stated GPU (h100-sxm)")
    off, why = settle_compile(TrainConfig(compile=False), stated)
    assert off.compile is False and "--no-compile" in why
    # optimize_wrap applying on CPU ranks: eager unless asked
    cpu, why = settle_compile(TrainConfig(), stated, apply_device="cpu")
    assert cpu.compile is False and "applied on CPU ranks" in why
    assert settle_compile(TrainConfig(compile=True), stated, apply_device="cpu")[0].compile is True


def test_the_default_step_is_priced_compiled_and_no_compile_prices_it_eager():
    model, x = zoo.build("llama-tiny", "meta")  # norms, rotary, SwiGLU: chains of memory-bound ops to fuse
    on, off = (prepare(ParallelRequest(mesh=MESH, memory_budget="none", train=TrainConfig.preset("bf16", compile=c)),
                       model, x, fabric="h100-sxm+ib400") for c in (None, False))
    assert on.sim.options.compile and not off.sim.options.compile
    plan = plan_model(on, search=SearchOptions(trials=0))[0]
    assert plan.to_json()["train"]["compile"] is True
    # compiled: the memory-bound ops fused, so the same plan is faster than eager
    assert on.sim.simulate(plan.spec).step_s < off.sim.simulate(plan.spec).step_s


def test_float8_auto_tries_every_recipe_and_the_all_gather_only_where_fsdp_gathers():
    job = _job(TrainConfig(float8="auto"))
    steps, line = float8_choices(job.train, job.compute, MESH)
    assert [(s.float8, s.float8_all_gather) for s in steps] == [
        ("none", False), ("tensorwise", False), ("tensorwise", True), ("rowwise", False)]
    assert line == ""  # the search's line says it
    one = replace(MESH, world_size=1, ranks_per_node=1, shard_size=1)
    assert ("tensorwise", True) not in [(s.float8, s.float8_all_gather) for s in float8_choices(
        job.train, job.compute, one)[0]]
    fixed = float8_choices(TrainConfig(float8="rowwise"), job.compute, MESH)
    assert len(fixed[0]) == 1 and fixed[1] == "float8: rowwise, as asked (--float8 rowwise)"


def test_float8_auto_skips_a_model_whose_linears_the_filter_leaves_out():
    """gpt-tiny's linears are all too small for torchao's auto filter: --float8 auto tries nothing
    (no screen of four identical steps) and says why; left off, the hint says the same."""
    model, x = zoo.build("gpt-tiny", "meta")
    job = prepare(ParallelRequest(mesh=MESH, memory_budget="none", train=TrainConfig(float8="auto")), model, x,
                  fabric="h100-sxm+ib400")
    steps, line = float8_choices(job.train, job.compute, MESH, job.sim)
    assert [s.float8 for s in steps] == ["none"] and "no linear passes TorchTitan's float8 filter" in line
    assert len(float8_choices(job.train, job.compute, MESH)[0]) == 4  # without the model: every recipe
    from wrapopt.search.knobs import float8_hint

    plan = plan_model(job, search=SearchOptions(trials=0))[0]
    assert "it would gain nothing here: no linear passes" in float8_hint(job.sim, plan.spec, 1.0, job.compute)


def test_float8_auto_chooses_the_fastest_recipe_and_the_plan_records_it(searched):
    (auto, plan, result), (_off, off_plan, off_result) = searched
    train = plan.train_config
    assert train.float8 in ("tensorwise", "rowwise") and train.compile is True
    line = next(k for k in result.knobs if k.startswith("float8:"))
    assert "chosen (--float8 auto)" in line and all(w in line for w in ("none ", "tensorwise ", "rowwise "))
    # the answer is priced with the recipe chosen, and beats the search without float8
    assert result.best.estimate.step_s < off_result.best.estimate.step_s
    again = auto.simulator(train).simulate(plan.spec)
    assert again.step_s == pytest.approx(result.best.estimate.step_s, rel=1e-9)
    saved = plan.to_json()["train"]
    assert saved["float8"] == train.float8 and saved.get("float8_all_gather", False) == train.float8_all_gather
    assert any(k in plan.fabric["notes"] for k in result.knobs)
    text = format_report(result, auto.fabric, auto.compute, MESH)
    assert line in text and next(k for k in result.knobs if k.startswith("compile:")) in text


def test_float8_off_by_default_names_what_tensorwise_would_gain(searched):
    _auto, (off, plan, result) = searched
    assert plan.train_config.float8 == "none"
    line = next(k for k in result.knobs if k.startswith("float8:"))
    assert line.startswith("float8: off (it changes numerics") and "--float8 auto searches it" in line
    opts = replace(off.sim.options, float8="tensorwise", float8_all_gather=True)
    from wrapopt.cost.simulate import Simulator

    fp8 = Simulator(off.graph, off.fabric, off.compute, opts).simulate(plan.spec).step_s
    gain = 1 - fp8 / result.best.estimate.step_s
    assert gain > 0.05 and f"would make this plan {gain:.0%} faster" in line


def test_the_torchtitan_export_writes_the_chosen_converter(searched):
    (_auto, plan, _result), _off = searched
    from wrapopt.interop.torchtitan import export_torchtitan

    text = export_torchtitan(plan, model=None, source="plan.json").text
    assert "float8" in text and "[compile]" in text
