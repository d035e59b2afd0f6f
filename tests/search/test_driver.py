"""search/driver.py: conformance of every strategy, the budget, HSDP and the
infeasible-budget message."""

from __future__ import annotations

import math
import re

import pytest

from tests.search.common import check_conforms, make_sim, random_plans, zoo_graph
from wrapopt.errors import InfeasibleError
from wrapopt.search.baselines import baselines
from wrapopt.search.dp.plans import dp_plans
from wrapopt.search.driver import SearchOptions, dp_shard_sizes, search_plan
from wrapopt.search.study.space import shard_sizes
from wrapopt.spec import MeshSpec


# A conformance suite (optuna's pattern): each strategy yields plans through one function.
STRATEGIES = {
    "baselines": lambda g, mesh, sim, budget: list(baselines(g, mesh).values()),
    "dp": lambda g, mesh, sim, budget: [p for _, p, _ in dp_plans(
        sim, mesh, g.block_chains, memory_budget=budget or float("inf"), static_bytes=0.0)],
    "search": lambda g, mesh, sim, budget: [search_plan(g, sim, mesh, memory_budget=budget).best.plan],
    "dp-per-unit-hsdp": lambda g, mesh, sim, budget: [
        p for s in dp_shard_sizes(mesh) for _, p, _ in
        dp_plans(sim, MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=s),
                 g.block_chains, memory_budget=budget or math.inf, uniform=False)],
    "optuna": lambda g, mesh, sim, budget: [
        search_plan(g, sim, mesh, memory_budget=budget, options=SearchOptions(trials=40, seed=3)).optuna_best.plan],
    "space-random": lambda g, mesh, sim, budget: random_plans(g, mesh, 30, seed=5),
}

BUDGETED = {"search", "optuna", "dp-per-unit-hsdp"}  # plans these return must fit the budget


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_strategy_conformance(setup, strategy):
    g, mesh, sim = setup
    probe = search_plan(g, sim, mesh)
    peaks = sorted(s.estimate.peak_bytes for s in probe.candidates)
    budget = peaks[len(peaks) // 2]  # half the candidates fit
    plans = STRATEGIES[strategy](g, mesh, sim, budget)
    assert plans
    for plan in plans:
        est = sim.simulate(plan)
        check_conforms(g, plan, budget if strategy in BUDGETED else None, est)
    # Deterministic: the same call gives the same plans.
    again = STRATEGIES[strategy](g, mesh, sim, budget)
    assert [p.units for p in plans] == [p.units for p in again]


def test_search_respects_budget_and_prefers_faster(setup):
    g, mesh, sim = setup
    res = search_plan(g, sim, mesh)
    fitting = [s for s in res.candidates if s.fits]
    assert res.fastest.estimate.step_s <= min(s.estimate.step_s for s in fitting) + 1e-12
    # The choice is the simplest plan within the simulator's error of the fastest: See [Note: plans within the error].
    assert res.best.fits and res.why
    tight = sorted(s.estimate.peak_bytes for s in res.candidates)[1]
    res2 = search_plan(g, sim, mesh, memory_budget=tight)
    assert res2.best.estimate.peak_bytes <= tight
    assert res2.fastest.estimate.step_s >= res.fastest.estimate.step_s - 1e-12


def test_infeasible_budget_names_smallest_peak(setup):
    g, mesh, sim = setup
    with pytest.raises(InfeasibleError, match="smallest predicted peak"):
        search_plan(g, sim, mesh, memory_budget=1024)


# --- HSDP ------------------------------------------------------------------------------------------


def test_shard_sizes_one_node_several_nodes_world():
    mesh = MeshSpec(world_size=64, ranks_per_node=8, shard_size=64)
    assert shard_sizes(mesh) == (1, 2, 4, 8, 16, 32, 64)
    assert dp_shard_sizes(mesh) == (64, 32, 16, 8)
    assert dp_shard_sizes(MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)) == (8,)


def test_search_tries_hsdp_when_the_world_spans_nodes():
    g = zoo_graph("llama-tiny")
    mesh = MeshSpec(world_size=64, ranks_per_node=8, shard_size=64)
    sim = make_sim(g, 64)
    res = search_plan(g, sim, mesh)
    shards = {p.mesh.shard_size for p in res.round("dp").proposed}
    assert {64, 8} <= shards
    # The fastest HSDP answer is at least as fast as FSDP over the world here (tiny model, slow inter-node links).
    assert res.best.plan.mesh.shard_size < 64
    fixed = search_plan(g, sim, mesh, options=SearchOptions(shard_sizes=(64,)))
    assert {p.mesh.shard_size for p in fixed.round("dp").proposed} == {64}


# --- an infeasible budget --------------------------------------------------------------------------


def test_infeasible_budget_says_what_would_fit():
    g = zoo_graph("llama-7b")
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    sim = make_sim(g, 8)
    with pytest.raises(InfeasibleError) as err:
        search_plan(g, sim, mesh, memory_budget=6 * 2**30)
    msg = str(err.value)
    assert "\n" not in msg
    assert "smallest predicted peak is" in msg and "ckpt, shard group 8" in msg  # checkpointing is already on
    # 7B on 8 ranks does not fit 6 GiB; the suggested number of ranks is the smallest that does.
    found = re.search(r"more ranks: sharding over (\d+) ranks brings it to ([\d.]+) GiB", msg)
    assert found and int(found.group(1)) > 8 and float(found.group(2)) <= 6.0
    with pytest.raises(InfeasibleError, match="more ranks alone will not do"):
        search_plan(g, sim, mesh, memory_budget=1 * 2**30)
