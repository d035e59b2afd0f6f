"""The expert-parallel degree loop (search/ep.py): each degree searched beside FSDP alone, reported."""

from __future__ import annotations

import pytest

from wrapopt import zoo
from wrapopt.cost.simulate import Simulator
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.search.driver import SearchOptions
from wrapopt.search.ep import search_ep
from wrapopt.search.shapes import shape_space
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.trace import trace_model


@pytest.fixture(scope="module")
def moe():
    model, x = zoo.build("moe-tiny", "meta")
    return trace_model(model, x, fx=False)


def test_ep_auto_searches_each_degree_beside_fsdp_alone(moe):
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    space = shape_space(moe, ParallelRequest(mesh=mesh, ep="auto"))
    assert space.ep == (2, 4)  # the degrees dividing moe-tiny's 4 experts and the 8 ranks
    sim = Simulator(moe, analytical_fabric(world_size=8), analytical_compute())
    res = search_ep(moe, sim, mesh, degrees=space.ep, memory_budget=None, options=SearchOptions(trials=0))
    rows = dict(res.tp_rows)
    assert list(rows) == ["best FSDP alone (ep 1)", "best ep2", "best ep4"]
    assert rows["best FSDP alone (ep 1)"].plan.mesh.ep_size == 1
    for d in (2, 4):
        s = rows[f"best ep{d}"]
        assert s.plan.mesh.ep_size == d and s.plan.label.endswith(f" + ep{d}")
        assert s.estimate.step_s == pytest.approx(sim.simulate(s.plan).step_s)  # lifted: scores as the full mesh
    note = next(n for n in res.notes if n.startswith("expert parallel: "))
    assert all(f"ep {d}: " in note for d in (1, 2, 4)) and "chosen" in note
    assert res.best.plan.mesh.ep_size in (1, 2, 4)
