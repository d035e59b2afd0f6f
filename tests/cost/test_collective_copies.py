"""[Note: collective copies] in cost/step.py: a fabric whose collectives copy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wrapopt import zoo
from wrapopt.cost.simulate import Simulator
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec
from wrapopt.trace import trace_model


@pytest.fixture(scope="module")
def llama():
    model, x = zoo.build("llama-tiny", "meta")
    return trace_model(model, x)


def test_a_copying_backend_adds_its_copy_at_the_copy_out(llama):
    """[Note: collective copies]: a single unit's copy-out holds the gathered model twice over
    on a fabric whose collectives copy; a fabric that does not copy predicts as before."""
    fabric, compute = analytical_fabric(world_size=2), replace(analytical_compute(), runs_ahead=False)
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    one = baselines(llama, mesh)["root-only"]
    plain = Simulator(llama, fabric, compute).simulate(one)
    copying = Simulator(llama, replace(fabric, collective_copies=1.0), compute).simulate(one)
    gathered = dict(plain.peak_breakdown)["unsharded_params"]
    assert copying.peak_bytes >= plain.peak_bytes
    assert copying.peak_bytes == pytest.approx(max(plain.peak_bytes, dict(copying.peak_breakdown)["sharded_params"]
                                                   + dict(copying.peak_breakdown)["optimizer_state"]
                                                   + 3 * gathered), rel=0.02)
