"""search/dp/: the exact DP over block chains equals brute force (uniform and
per-unit choices, one and two chains), and its answers hold in the simulator."""

from __future__ import annotations

import itertools
import math

import pytest

from tests.search.common import make_sim, zoo_graph
from wrapopt.cost import Simulator
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.search.dp.chain import brute_force_chain, chain_costs, chain_model, unit_choices
from wrapopt.search.dp.plans import ChainDP, dp_plans
from wrapopt.search.dp.bounds import GroupTables, grid_bounds
from wrapopt.search.dp.solve import lower_bound, solve_chain, solve_chains
from wrapopt.search.choose import MEMORY_ERROR
from wrapopt.search.driver import search_plan
from wrapopt.spec import MeshSpec


@pytest.mark.parametrize("runs_ahead", [True, False])
@pytest.mark.parametrize("reshard,ckpt", list(itertools.product([True, False], [False, True])))
def test_dp_equals_brute_force(runs_ahead, reshard, ckpt):
    g = zoo_graph("llama-tiny")  # 6 blocks: 32 compositions
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    compute = analytical_compute()
    if not runs_ahead:
        compute = ComputeProfile(kind="measured", device="cpu", runs_ahead=False,
                                 flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10,
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


# --- the DP with per-unit choices ------------------------------------------------------------------


def _allowances(cc, choices, n_blocks):
    """Allowances from 'almost nothing fits' to 'everything fits' for this chain."""
    peaks = [chain_model(cc, zip(sizes, picks))[1]
             for sizes in [(1,) * n_blocks, (n_blocks,), (2,) * (n_blocks // 2) + (1,) * (n_blocks % 2)]
             for picks in itertools.product(choices, repeat=len(sizes))]
    lo, hi = min(peaks), max(peaks)
    return [lo - 1, lo] + [lo + f * (hi - lo) for f in (0.03, 0.1, 0.3, 0.6)] + [hi, math.inf]


@pytest.mark.parametrize("cpu", [False, True])
def test_per_unit_dp_equals_brute_force_6_blocks(cpu):
    """Every grouping of a 6-block chain times every per-unit (reshard, checkpoint)
    choice: the DP's answer equals the best brute-force answer at each allowance."""
    g = zoo_graph("llama-tiny")
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    cc = chain_costs(make_sim(g, 8, cpu=cpu), mesh, g.block_chains[0], max_group=6)
    choices = unit_choices(mesh)
    assert len(choices) == 4 and len(cc.blocks) == 6  # 4 * 5**5 = 12500 plans
    for allowance in _allowances(cc, choices, 6):
        dp = solve_chain(cc, choices=choices, max_group=6, mem_allowance=allowance)
        bf = brute_force_chain(cc, choices=choices, max_group=6, mem_allowance=allowance)
        assert (dp is None) == (bf is None), allowance
        if dp is not None:
            assert dp[0] == pytest.approx(bf[0], rel=1e-12)
            assert lower_bound([cc], choices=choices, max_group=6, mem_allowance=allowance) <= bf[0] * (1 + 1e-12)
            t, peak, _a = chain_model(cc, zip(dp[1], dp[2]))  # the DP's plan really has its time and fits
            assert t == pytest.approx(dp[0], rel=1e-12) and peak <= allowance


def test_per_unit_dp_with_node_reshard_equals_brute_force():
    """A shard group spanning nodes adds reshard-to-one-node: 6 choices per unit on a 5-block chain."""
    g = zoo_graph("llama-tiny")
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    cc = chain_costs(make_sim(g, 16), mesh, g.block_chains[0][:5], max_group=5)
    choices = unit_choices(mesh)
    assert (8, True) in choices and len(choices) == 6
    for allowance in _allowances(cc, choices, 5)[1::2]:
        dp = solve_chain(cc, choices=choices, max_group=5, mem_allowance=allowance)
        bf = brute_force_chain(cc, choices=choices, max_group=5, mem_allowance=allowance)
        assert (dp is None) == (bf is None)
        if dp is not None:
            assert dp[0] == pytest.approx(bf[0], rel=1e-12)


def test_two_chain_dp_equals_brute_force():
    """An encoder-decoder: the encoder's kept memory is alive in the decoder's backward;
    the joint optimum over both chains equals brute force over both."""
    g = zoo_graph("t5-tiny")
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    dp = ChainDP(make_sim(g, 8), mesh, g.block_chains, max_group=3)
    c1, c2 = dp.costs
    choices = dp.choices

    def options(cc):
        for sizes in [(1, 1, 1), (1, 2), (2, 1), (3,)]:
            for picks in itertools.product(choices, repeat=len(sizes)):
                yield list(zip(sizes, picks))

    pairs = []
    for g1 in options(c1):
        t1, p1, a1 = chain_model(c1, g1)
        for g2 in options(c2):
            t2, p2, _ = chain_model(c2, g2, a0=a1)
            pairs.append((t1 + t2, max(p1, p2)))
    peaks = sorted(p for _, p in pairs)
    for allowance in (peaks[0], peaks[len(peaks) // 50], peaks[len(peaks) // 4], peaks[-1]):
        best = min((t for t, p in pairs if p <= allowance), default=None)
        ans = solve_chains(dp.costs, choices=choices, max_group=3, mem_allowance=allowance)
        assert (ans is None) == (best is None)
        if ans is not None:
            assert ans.time_s == pytest.approx(best, rel=1e-12)
            assert lower_bound(dp.costs, choices=choices, max_group=3, mem_allowance=allowance) <= best * (1 + 1e-12)


def test_tuned_bound_is_below_the_optimum_and_above_the_grid():
    """[Note: tuned multiplier]: the bound with its multiplier tuned to the allowance
    never exceeds the brute-force optimum (the branch and bound would lose it) and is
    never weaker than the best multiplier of the fixed grid; tuning tightens it somewhere."""
    g = zoo_graph("llama-tiny")
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    cc = chain_costs(make_sim(g, 16), mesh, g.block_chains[0][:5], max_group=5)
    choices = unit_choices(mesh)
    grid = grid_bounds([cc], [GroupTables(cc, choices, 5)], {})
    gains = []
    for allowance in _allowances(cc, choices, 5)[:-1]:
        lb = lower_bound([cc], choices=choices, max_group=5, mem_allowance=allowance)
        coarse = float(grid.global_bound(0.0, allowance).max())
        assert lb >= coarse
        bf = brute_force_chain(cc, choices=choices, max_group=5, mem_allowance=allowance)
        if bf is not None:
            assert lb <= bf[0] * (1 + 1e-12)
            gains.append(lb - coarse)
    assert len(gains) >= 4 and max(gains) > 0


def test_per_unit_dp_not_slower_than_uniform(setup):
    g, mesh, sim = setup
    peaks = sorted(s.estimate.peak_bytes for s in search_plan(g, sim, mesh).candidates)
    for budget in (peaks[len(peaks) // 3], math.inf):
        answers = dp_plans(sim, mesh, g.block_chains, memory_budget=budget, rescore=False)
        per_unit = [t for label, _, t in answers if label == "dp"]
        uniform = [t for label, _, t in answers if label.startswith("dp(")]
        if per_unit:
            assert all(per_unit[0] <= t * (1 + 1e-12) for t in uniform)
        else:
            assert not uniform


def test_dp_answer_fits_the_simulator(setup):
    """The chain model leaves terms out; the re-scored DP answer still fits the budget."""
    g, mesh, sim = setup
    peaks = sorted(s.estimate.peak_bytes for s in search_plan(g, sim, mesh).candidates)
    budget = peaks[len(peaks) // 3]
    for _label, plan, _t in dp_plans(sim, mesh, g.block_chains, memory_budget=budget, uniform=False):
        assert sim.simulate(plan).peak_bytes <= budget


def test_a_carried_shrink_starts_the_rescoring_lower_and_still_fits():
    """[Note: carried shrink]: ``answers(shrink=)`` starts the per-unit DP with the allowance
    lowered by that much; the answer still fits the simulator's peak, is never faster than the
    one found from no shrink, and reports the shrink it ended with."""
    g = zoo_graph("llama-tiny")
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    sim = make_sim(g, 8)
    dp = ChainDP(sim, mesh, g.block_chains, max_group=3)
    free = dp.answers(math.inf, uniform=False)[0]
    budget = dp.static_bytes + 0.6 * (sim.simulate(free.plan).peak_bytes - dp.static_bytes)
    plain = dp.answers(budget, uniform=False)[0]
    assert plain.shrink == 0  # it fits at once: the chain-model optimum under the budget
    carried = 0.2 * (budget - dp.static_bytes)
    got = ChainDP(sim, mesh, g.block_chains, max_group=3).answers(budget, uniform=False, shrink=carried)
    assert got and got[0].shrink >= carried
    assert sim.simulate(got[0].plan).peak_bytes <= budget
    assert got[0].time_s >= plain.time_s * (1 - 1e-12)


def test_the_dp_uses_what_its_memory_bound_leaves_under_the_budget(monkeypatch):
    """[Note: chain model slack]: vit-tiny on 16 ranks under a budget where the chain model's bound
    rules out one checkpointed unit per block on shard groups of 8 (4.50 MiB) but the simulator
    fits it: the DP finds that plan or a faster one; without the slack step its best is slower."""
    import wrapopt.search.dp.plans as plans

    g = zoo_graph("vit-tiny")
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    sim = Simulator(g, analytical_fabric(world_size=16), analytical_compute())
    m8 = MeshSpec(world_size=16, ranks_per_node=8, shard_size=8)
    ckpt8 = next(s for s in search_plan(g, sim, m8).candidates if s.plan.label.startswith("per-block,ckpt"))
    budget = 1.15 * ckpt8.estimate.peak_bytes  # the DP gets the budget less the memory error: 1.104x
    dp8 = ChainDP(sim, m8, g.block_chains)
    assert not dp8.answers(budget * (1 - MEMORY_ERROR), uniform=False)  # the bound alone: nothing fits
    best = search_plan(g, sim, mesh, memory_budget=budget).dp_best
    assert best.estimate.peak_bytes <= budget and best.estimate.step_s <= ckpt8.estimate.step_s
    monkeypatch.setattr(plans, "SLACK_TRIES", 0)
    without = search_plan(g, sim, mesh, memory_budget=budget).dp_best
    assert without.estimate.step_s > 1.2 * best.estimate.step_s
