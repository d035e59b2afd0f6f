"""The second-tier memory check (evaluation/memcheck.py): FSDPMemTracker in a fresh interpreter
on a fake process group, against the simulator's GPU-path prediction."""

from __future__ import annotations

import pytest

from wrapopt.cost.simulate import Simulator
from wrapopt.evaluation.memcheck import run_fake_check
from wrapopt.fingerprint import model_fingerprint
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec
from wrapopt.trace import trace_model


def test_run_fake_check_tracks_a_plan_in_a_fresh_interpreter():
    """The subprocess finds its own module (it moved once and the fidelity benchmark lost a run)
    and its peak agrees with the simulator's on FSDP2's GPU path."""
    model, x = zoo.build("gpt-tiny", "meta")
    graph = trace_model(model, x)
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    plan = baselines(graph, mesh)["per-block"]
    tracked = run_fake_check("gpt-tiny", [WrapPlan(spec=plan, model=model_fingerprint(model)).to_json()], world_size=2,
                             timeout_s=300)
    assert len(tracked) == 1 and tracked[0]["Total"] > 0
    pred = Simulator(graph, analytical_fabric(world_size=2), analytical_compute()).simulate(plan).peak_bytes
    assert pred == pytest.approx(tracked[0]["Total"], rel=0.05)
