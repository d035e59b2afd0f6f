"""The throughput knobs' defaults and search said wrongly (issue 52, [Note: knob defaults] in
wrapopt/search/knobs.py): float8 asked on a GPU without FP8 tensor cores, ``--float8 auto`` where it
cannot be tried, the float8 all-gather without float8, and ``auto`` where one step is scored."""

from __future__ import annotations

import pytest

from tests.reliability.common import ERROR, USAGE, assert_api_refuses, assert_cli_refuses
from wrapopt import zoo
from wrapopt.errors import OptionError
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.job import prepare
from wrapopt.search.knobs import float8_choices
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.train import TrainConfig

GPT = ["zoo:gpt-tiny", "--world-size", "2", "--trials", "0"]
CPU = ComputeProfile(kind="measured", device="cpu", runs_ahead=False, flops_per_s=5e10,
                     memory_bandwidth_bytes_per_s=1e10, unit_overhead_s=1e-3)
MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)


@pytest.mark.parametrize("command", ["search", "estimate"])
def test_float8_asked_on_an_a100_names_the_gpu_and_the_recipes(command, capsys):
    argv = [command, *GPT[:3], *(GPT[3:] if command == "search" else []), "--gpu", "a100-80gb-sxm",
            "--float8", "tensorwise"]
    assert_cli_refuses(argv, ERROR, ("--float8 tensorwise", "a100-80gb-sxm", "FP8 tensor cores",
                                     "tensorwise and rowwise", "--gpu h100-sxm"), capsys)


def test_float8_all_gather_without_float8_is_refused_naming_the_flag(capsys):
    assert_cli_refuses(["search", *GPT, "--float8-all-gather"], ERROR,
                       ("--float8-all-gather", "--float8 tensorwise"), capsys)
    # with --float8 auto: the search tries the all-gather itself, and the line says so
    assert_cli_refuses(["search", *GPT, "--float8", "auto", "--float8-all-gather"], ERROR,
                       ("--float8 tensorwise", "--float8 auto searches the all-gather itself"), capsys)


def test_float8_auto_where_one_step_is_scored_is_refused(capsys):
    # wrapopt estimate scores one step: auto is not among its choices (argparse names them)
    assert_cli_refuses(["estimate", *GPT[:3], "--float8", "auto"], USAGE, ("--float8", "invalid choice", "rowwise"),
                       capsys)
    model, x = zoo.build("gpt-tiny", "meta")
    from wrapopt.api import estimate

    assert_api_refuses(lambda: estimate(model, x, world_size=2, train=TrainConfig(float8="auto")), OptionError,
                       ("float8 auto", "chosen by a search", "none, tensorwise, rowwise"))
    assert_api_refuses(lambda: TrainConfig(float8="auto").sim_options(), OptionError, ("--float8 auto",))


def test_float8_auto_on_a_measured_cpu_is_explained_and_compile_stays_off():
    """--float8 auto on a measured CPU profile: not tried, one line saying why (no FP8 rate); the
    default compile is off there, and its line says why (eager kernel times, inductor's cold CPU compile)."""
    model, x = zoo.build("gpt-tiny", "meta")
    job = prepare(ParallelRequest(mesh=MESH, memory_budget="none", train=TrainConfig(float8="auto")), model, x,
                  compute=CPU)
    assert job.train.compile is False and job.sim.options.compile is False
    assert any("compile: off by default on a measured profile (cpu)" in k and "30 s and more cold" in k
               for k in job.knobs)
    steps, line = float8_choices(job.train, job.compute, MESH)
    assert [s.float8 for s in steps] == ["none"]
    assert line.startswith("float8: not tried (--float8 auto), a measured profile (cpu) has no FP8 rate")
    from wrapopt.api import plan_model
    from wrapopt.search.driver import SearchOptions

    plan, result = plan_model(job, search=SearchOptions(trials=0))
    assert plan.train_config.float8 == "none" and plan.train_config.compile is False
    assert line in result.knobs and line in plan.fabric["notes"]


def test_float8_auto_on_an_a100_is_not_tried_and_says_why():
    model, x = zoo.build("gpt-tiny", "meta")
    job = prepare(ParallelRequest(mesh=MESH, memory_budget="none", train=TrainConfig(float8="auto")), model, x,
                  fabric="a100-80gb-sxm+ib200")
    steps, line = float8_choices(job.train, job.compute, MESH)
    assert [s.float8 for s in steps] == ["none"] and line == (
        "float8: not tried (--float8 auto), a100-80gb-sxm has no FP8 tensor cores")
    assert job.train.compile is True  # a stated GPU: compiled by default


def test_mfu_under_float8_is_against_the_compute_dtypes_peak_and_says_so():
    """As TorchTitan reports it: float8 GEMMs counted against the bf16 peak, and the line says so."""
    from wrapopt.api import estimate

    model, x = zoo.build("llama-tiny", "meta")
    runs = {f8: estimate(model, x, world_size=8, fabric="h100-nvlink-ib400",
                         train=TrainConfig.preset("bf16", float8=f8)) for f8 in ("none", "tensorwise")}
    assert runs["none"].peak_flops_per_s == runs["tensorwise"].peak_flops_per_s  # the same bf16 peak
    assert "float8" not in runs["none"].peak_source
    assert "float8 tensorwise GEMMs counted against it" in runs["tensorwise"].peak_source
