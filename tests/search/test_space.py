"""search/study/space.py: the Optuna search space expresses every baseline and DP
answer, never splits tied parameters, and its random points are legal plans."""

from __future__ import annotations

import math

import pytest
import torch.nn as nn

from tests.search.common import check_conforms, make_sim, random_plans, zoo_graph
from wrapopt.search.baselines import baselines
from wrapopt.search.dp.plans import dp_plans
from wrapopt.search.study.space import SearchSpace
from wrapopt.spec import MeshSpec
from wrapopt.trace.meta import trace_model


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny", "llama-7b"])
def test_space_expresses_every_baseline_and_dp_answer(name):
    g = zoo_graph(name)
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    space = SearchSpace(g, mesh)
    plans = list(baselines(g, mesh).values())
    plans += [p for s in (16, 8) for _, p, _ in dp_plans(
        make_sim(g, 16), MeshSpec(world_size=16, ranks_per_node=8, shard_size=s), g.block_chains,
        memory_budget=math.inf)]
    for plan in plans:
        params = space.encode(plan)
        assert params is not None, plan.label
        again = space.from_params(params)
        assert sorted((u.modules, u.reshard_after_forward, u.checkpoint) for u in again.units) == \
            sorted((u.modules, u.reshard_after_forward, u.checkpoint) for u in plan.units)
        assert again.mesh == plan.mesh and again.forward_prefetch == plan.forward_prefetch


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.out(self.fc(x))


class _SharedAcrossBlocks(nn.Module):
    """Blocks 1 and 2 share one weight; block 0's ``out`` shares the embedding's."""

    def __init__(self, tie_outside: bool):
        super().__init__()
        self.emb = nn.Linear(8, 8)
        self.layers = nn.ModuleList(_Block() for _ in range(4))
        self.layers[2].fc.weight = self.layers[1].fc.weight
        if tie_outside:
            self.layers[0].out.weight = self.emb.weight
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        x = self.emb(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("tie_outside", [False, True])
def test_space_never_splits_tied_parameters(tie_outside):
    import torch

    g = trace_model(_SharedAcrossBlocks(tie_outside), (torch.randn(2, 8),))
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    space = SearchSpace(g, mesh)
    if tie_outside:
        assert space.chains[0] == ()  # a tie reaching outside the chain: its blocks are never units
    else:
        assert space.joined[0] == frozenset({2})  # no unit may start at block 2
        assert "fc" not in space.inner[0] and "out" in space.inner[0]
    for plan in random_plans(g, mesh, 300, seed=11):
        check_conforms(g, plan, None)


def test_random_space_points_are_legal_on_every_zoo_model():
    for name in ("gpt-tiny", "t5-tiny", "vit-tiny"):
        g = zoo_graph(name)
        mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
        for plan in random_plans(g, mesh, 100, seed=1):
            check_conforms(g, plan, None)
