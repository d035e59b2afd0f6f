"""evaluation/bench.py: measured steps of several plans on 2 gloo ranks, in the
shared spawn (See tests/ranks.py)."""

from __future__ import annotations

import pytest

from tests.ranks import MESH2, plan_specs, two_rank_case, zoo_graph
from wrapopt.models import zoo

pytestmark = pytest.mark.multiprocess


@two_rank_case
def bench_case(rank: int, world: int, tmp: str, out: dict) -> None:
    from wrapopt.evaluation.bench import measure_plans

    e = zoo.get_entry("gpt-tiny")
    specs = plan_specs(zoo_graph("gpt-tiny"), MESH2)
    plans = [specs["per-block"], specs["groups-of-2"], specs["per-block"]]
    got = measure_plans(lambda: e.build("cpu", seed=0), plans, e.inputs(), e.loss, repeats=3, warmup=1,
                        measure_memory=False)
    out["bench"] = [m.to_json() for m in got]


def test_measure_plans_times_every_plan_and_splits_its_steps_into_phases(two_rank_cases):
    got = two_rank_cases[0]["bench"]
    assert [len(m["times_s"]) for m in got] == [3, 3, 3]
    assert two_rank_cases[1]["bench"][0]["times_s"] == got[0]["times_s"]  # the slowest rank's, on every rank
    for m in got:
        phases = m["phase_s"]
        assert list(phases) == ["fwd", "bwd", "optim"] and all(v > 0 for v in phases.values())
        # Per rank the phases add up to the step; each phase is the slowest rank's, so their sum
        # may exceed the step's, never by more than the ranks' skew.
        assert 0.5 * m["step_s"] < sum(phases.values()) < 2 * m["step_s"]
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
