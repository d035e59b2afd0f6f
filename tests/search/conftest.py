"""The ``setup`` fixture of the search tests: each tiny zoo model, a 16-rank mesh, a simulator."""

from __future__ import annotations

import pytest

from tests.search.common import zoo_graph
from wrapopt.cost import Simulator
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.spec import MeshSpec


@pytest.fixture(scope="module", params=["gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny"])
def setup(request):
    g = zoo_graph(request.param)
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    sim = Simulator(g, analytical_fabric(world_size=16), analytical_compute())
    return g, mesh, sim
