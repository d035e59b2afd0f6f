"""evaluation/bench.py: steps of several plans on 2 gloo ranks, in the shared spawn (See
tests/ranks.py), timed on a synthetic clock that the model and the optimizer advance: the
figures are exact, and no assertion is about wall time."""

from __future__ import annotations

import time
import types

import pytest
import torch

from tests.ranks import MESH2, plan_specs, two_rank_case, zoo_graph
from wrapopt.models import zoo

pytestmark = pytest.mark.multiprocess

# Seconds the synthetic clock advances in each phase of a step, by rank: rank 0 has the shorter
# forward and the longer backward, so the slowest rank differs from phase to phase.
FWD_S, BWD_S, OPTIM_S = (1.0, 2.0), (4.0, 2.0), 0.5


def _clocked_measure(rank: int, build, *args, **kwargs):
    """``measure_plans(build, *args, **kwargs)`` with bench.py's clock replaced by one that only
    the steps advance: each model's forward by ``FWD_S[rank]``, its backward by ``BWD_S[rank]``,
    each optimizer step by ``OPTIM_S``."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from wrapopt.evaluation import bench

    clock = [0.0]

    def advance(seconds: float) -> None:
        clock[0] += seconds

    def forward_done(_module, _args, output: torch.Tensor) -> None:
        advance(FWD_S[rank])
        output.register_hook(lambda _grad: advance(BWD_S[rank]))

    def clocked_build() -> torch.nn.Module:
        model = build()
        model.register_forward_hook(forward_done)  # kept by fully_shard
        return model

    handle = register_optimizer_step_post_hook(lambda *_: advance(OPTIM_S))
    real_time = bench.time
    bench.time = types.SimpleNamespace(perf_counter=lambda: clock[0], process_time=time.process_time)
    try:
        return bench.measure_plans(clocked_build, *args, **kwargs)
    finally:
        bench.time = real_time
        handle.remove()


@two_rank_case
def bench_case(rank: int, world: int, tmp: str, out: dict) -> None:
    e = zoo.get_entry("gpt-tiny")
    specs = plan_specs(zoo_graph("gpt-tiny"), MESH2)
    plans = [specs["per-block"], specs["groups-of-2"], specs["per-block"]]
    got = _clocked_measure(rank, lambda: e.build("cpu", seed=0), plans, e.inputs(), e.loss, repeats=3, warmup=1,
                           measure_memory=False)
    out["bench"] = [m.to_json() for m in got]


def test_measure_plans_times_every_plan_and_splits_its_steps_into_phases(two_rank_cases):
    got = two_rank_cases[0]["bench"]
    # A rank's step is its phases' sum: 1 + 4 + 0.5 s on rank 0, 2 + 2 + 0.5 s on rank 1. The
    # step is the slowest rank's, on every rank, each timed round after the warm-up.
    assert [m["times_s"] for m in got] == [[5.5] * 3] * 3 and [m["step_s"] for m in got] == [5.5] * 3
    assert [m["times_s"] for m in two_rank_cases[1]["bench"]] == [[5.5] * 3] * 3
    for m in got:
        # Each phase is the slowest rank's (forward rank 1's, backward rank 0's), so their sum
        # exceeds the step's by the ranks' skew.
        assert m["phase_s"] == {"fwd": 2.0, "bwd": 4.0, "optim": 0.5}
    # Same model, seed and batch: the plans train alike, however the rounds were ordered.
    for m in got[1:]:
        assert m["losses"] == pytest.approx(got[0]["losses"], rel=1e-5)


@two_rank_case
def bench_warnings_case(rank: int, world: int, tmp: str, out: dict) -> None:
    from wrapopt.evaluation.bench import measure_plans
    from wrapopt.search.baselines import baselines

    e = zoo.get_entry("gpt-tiny")
    base = baselines(zoo_graph("gpt-tiny"), MESH2)
    got = measure_plans(lambda: e.build("cpu", seed=0), [base["per-block"], base["every-leaf"]], e.inputs(), e.loss,
                        repeats=1, warmup=0, measure_memory=False)
    out["bench_warnings"] = {m.label: list(m.warnings) for m in got}


def test_measure_plans_records_which_plans_raised_fsdps_view_warning(two_rank_cases):
    got = two_rank_cases[0]["bench_warnings"]
    # every-leaf wraps each Linear, and a Linear with bias on 3-D input returns a view; a block
    # returns its residual sum, not a view.
    assert any("FSDP2-wrapped module (FSDPLinear) returned a view tensor" in w for w in got["every-leaf"])
    assert not any("returned a view tensor" in w for w in got["per-block"])
