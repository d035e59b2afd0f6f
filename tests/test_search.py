"""Search: conformance of every strategy, and the DP against brute force."""

from __future__ import annotations

import itertools

import pytest

from wrapopt import zoo
from wrapopt.cost import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.fabric import ComputeProfile, analytical_fabric
from wrapopt.search import baselines, search_plan
from wrapopt.search.dp import brute_force_chain, chain_costs, dp_plans, solve_chain
from wrapopt.trace import trace_model
from wrapopt.types import MeshSpec, PlanSpec
from wrapopt.units import owner_index, owner_of, validate_plan


def _graph(name: str):
    e = zoo.get_entry(name)
    return trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)


@pytest.fixture(scope="module", params=["gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny"])
def setup(request):
    g = _graph(request.param)
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    sim = Simulator(g, analytical_fabric(world_size=16), ComputeProfile.analytical())
    return g, mesh, sim


def _check_conforms(g, plan: PlanSpec, budget: float | None, est=None) -> None:
    """Every parameter in exactly one unit, tied groups together, within budget."""
    validate_plan(g, plan)
    idx = owner_index(plan.units)
    owners = {}
    for fqn, _shape, _dt in g.param_shapes:
        mod = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        owners[fqn] = owner_of(mod, idx)
    assert len(owners) == len(g.param_shapes)
    for group in g.tied_groups:
        units = {owner_of(p.rsplit(".", 1)[0], idx) for p in group}
        assert len(units) == 1, group
    listed = [m for u in plan.units for m in u.modules]
    assert len(listed) == len(set(listed))
    if budget is not None and est is not None:
        assert est.peak_bytes <= budget


# A conformance suite (optuna's pattern): each strategy yields plans through one function.
STRATEGIES = {
    "baselines": lambda g, mesh, sim, budget: list(baselines(g, mesh).values()),
    "dp": lambda g, mesh, sim, budget: [p for _, p, _ in dp_plans(sim, mesh, g.block_chains, memory_budget=budget or float("inf"), static_bytes=0.0)],
    "search": lambda g, mesh, sim, budget: [search_plan(g, sim, mesh, memory_budget=budget).best.plan],
}


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
        _check_conforms(g, plan, budget if strategy == "search" else None, est)
    # Deterministic: the same call gives the same plans.
    again = STRATEGIES[strategy](g, mesh, sim, budget)
    assert [p.units for p in plans] == [p.units for p in again]


def test_search_respects_budget_and_prefers_faster(setup):
    g, mesh, sim = setup
    res = search_plan(g, sim, mesh)
    fitting = [s for s in res.candidates if s.fits]
    assert res.best.estimate.step_s <= min(s.estimate.step_s for s in fitting) + 1e-12
    tight = sorted(s.estimate.peak_bytes for s in res.candidates)[1]
    res2 = search_plan(g, sim, mesh, memory_budget=tight)
    assert res2.best.estimate.peak_bytes <= tight
    assert res2.best.estimate.step_s >= res.best.estimate.step_s - 1e-12


def test_infeasible_budget_names_smallest_peak(setup):
    g, mesh, sim = setup
    with pytest.raises(InfeasibleError, match="smallest predicted peak"):
        search_plan(g, sim, mesh, memory_budget=1024)


def test_baselines_are_the_named_policies():
    g = _graph("gpt-tiny")
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    b = baselines(g, mesh)
    assert set(b) == {"per-block", "size-1e8", "every-leaf", "root-only", "no-shard"}
    assert [u.modules for u in b["per-block"].units[:-1]] == [(f"layers.{i}",) for i in range(4)]
    assert len(b["root-only"].units) == 1 and len(b["size-1e8"].units) == 1  # nothing reaches 1e8 in a tiny model
    assert b["no-shard"].mesh.shard_size == 1
    leaves = {m for u in b["every-leaf"].units for m in u.modules}
    assert "wte" not in leaves and "lm_head" not in leaves  # tied: left to the root
    assert "layers.0.attn.q_proj" in leaves


def test_size_based_replays_fsdp1_on_llama7b():
    g = _graph("llama-7b")
    b = baselines(g, MeshSpec(world_size=64, ranks_per_node=8, shard_size=64))["size-1e8"]
    names = {m for u in b.units for m in u.modules}
    # FSDP1's recursion: each MLP (135M) reaches 1e8 and is wrapped; what is left of
    # its block (attention, 67M) does not, so the blocks themselves stay unwrapped.
    assert all(f"layers.{i}.mlp" in names and f"layers.{i}" not in names for i in range(32))
    assert "embed_tokens" in names and "lm_head" in names  # 131M each


@pytest.mark.parametrize("runs_ahead", [True, False])
@pytest.mark.parametrize("reshard,ckpt", list(itertools.product([True, False], [False, True])))
def test_dp_equals_brute_force(runs_ahead, reshard, ckpt):
    g = _graph("llama-tiny")  # 6 blocks: 32 compositions
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    compute = ComputeProfile.analytical()
    if not runs_ahead:
        compute = ComputeProfile(kind="measured", device="cpu", flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10,
                                 unit_overhead_s=1e-3)
    sim = Simulator(g, analytical_fabric(world_size=16), compute)
    cc = chain_costs(sim, mesh, g.block_chains[0], max_group=6)
    for allowance in (float("inf"), 0.6 * _max_mem(cc, reshard, ckpt)):
        dp = solve_chain(cc, reshard=reshard, ckpt=ckpt, max_group=6, mem_allowance=allowance)
        bf = brute_force_chain(cc, reshard=reshard, ckpt=ckpt, max_group=6, mem_allowance=allowance)
        assert (dp is None) == (bf is None)
        if dp is not None:
            assert dp[0] == pytest.approx(bf[0], rel=1e-12)
            assert sum(dp[1]) == len(cc.blocks)


def _max_mem(cc, reshard, ckpt):
    res = brute_force_chain(cc, reshard=reshard, ckpt=ckpt, max_group=6, mem_allowance=float("inf"))
    assert res is not None
    # An allowance that rules out the largest groups: the total of all blocks' bytes.
    return sum(cc.P) + sum(cc.G) + sum(cc.act)
