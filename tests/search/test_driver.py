"""Search: conformance of every strategy, the DP against brute force, the
search space's encoding, HSDP and the infeasible-budget message."""

from __future__ import annotations

import functools
import itertools
import math
import random
import re

import pytest
import torch.nn as nn

from wrapopt.cost import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.models import zoo
from wrapopt.search.baselines import baselines
from wrapopt.search.dp.chain import brute_force_chain, chain_costs, chain_model, unit_choices
from wrapopt.search.dp.solve import ChainDP, dp_plans, solve_chain, solve_chains
from wrapopt.search.driver import SearchOptions, dp_shard_sizes, search_plan
from wrapopt.search.study.space import SearchSpace, shard_sizes
from wrapopt.spec import MeshSpec, PlanSpec
from wrapopt.trace.meta import trace_model
from wrapopt.units import owner_index, owner_of, validate_plan


@functools.lru_cache(maxsize=None)
def _graph(name: str):
    e = zoo.get_entry(name)
    return trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)


@pytest.fixture(scope="module", params=["gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny"])
def setup(request):
    g = _graph(request.param)
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    sim = Simulator(g, analytical_fabric(world_size=16), analytical_compute())
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
    "dp-per-unit-hsdp": lambda g, mesh, sim, budget: [
        p for s in dp_shard_sizes(mesh) for _, p, _ in
        dp_plans(sim, MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=s),
                 g.block_chains, memory_budget=budget or math.inf, uniform=False)],
    "optuna": lambda g, mesh, sim, budget: [
        search_plan(g, sim, mesh, memory_budget=budget, options=SearchOptions(trials=40, seed=3)).optuna_best.plan],
    "space-random": lambda g, mesh, sim, budget: _random_plans(g, mesh, 30, seed=5),
}

BUDGETED = {"search", "optuna", "dp-per-unit-hsdp"}  # plans these return must fit the budget


def _random_plans(g, mesh, n: int, seed: int) -> list[PlanSpec]:
    """Plans from uniformly random points of the Optuna space (legal by construction)."""
    space = SearchSpace(g, mesh)
    rng = random.Random(seed)
    names = space.complete({})
    plans = []
    for _ in range(n):
        params = {}
        for name in names:
            choices = _choices_of(space, name)
            params[name] = rng.choice(choices)
        plans.append(space.from_params(params))
    return plans


def _choices_of(space: SearchSpace, name: str) -> tuple:
    seen = {}

    class _Rec:
        def cat(self, n, choices):
            seen[n] = choices
            return choices[0]

    space.decode(_Rec())
    return seen[name]


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
        _check_conforms(g, plan, budget if strategy in BUDGETED else None, est)
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
    compute = analytical_compute()
    if not runs_ahead:
        compute = ComputeProfile(kind="measured", device="cpu", runs_ahead=False, flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10,
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


def _sim(g, world: int, *, cpu: bool = False):
    compute = analytical_compute()
    if cpu:
        compute = ComputeProfile(kind="measured", device="cpu", runs_ahead=False, flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10,
                                 unit_overhead_s=1e-3)
    return Simulator(g, analytical_fabric(world_size=world), compute)


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
    g = _graph("llama-tiny")
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    cc = chain_costs(_sim(g, 8, cpu=cpu), mesh, g.block_chains[0], max_group=6)
    choices = unit_choices(mesh)
    assert len(choices) == 4 and len(cc.blocks) == 6  # 4 * 5**5 = 12500 plans
    for allowance in _allowances(cc, choices, 6):
        dp = solve_chain(cc, choices=choices, max_group=6, mem_allowance=allowance)
        bf = brute_force_chain(cc, choices=choices, max_group=6, mem_allowance=allowance)
        assert (dp is None) == (bf is None), allowance
        if dp is not None:
            assert dp[0] == pytest.approx(bf[0], rel=1e-12)
            t, peak, _a = chain_model(cc, zip(dp[1], dp[2]))  # the DP's plan really has its time and fits
            assert t == pytest.approx(dp[0], rel=1e-12) and peak <= allowance


def test_per_unit_dp_with_node_reshard_equals_brute_force():
    """A shard group spanning nodes adds reshard-to-one-node: 6 choices per unit on a 5-block chain."""
    g = _graph("llama-tiny")
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    cc = chain_costs(_sim(g, 16), mesh, g.block_chains[0][:5], max_group=5)
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
    g = _graph("t5-tiny")
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    dp = ChainDP(_sim(g, 8), mesh, g.block_chains, max_group=3)
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


# --- HSDP ------------------------------------------------------------------------------------------


def test_shard_sizes_one_node_several_nodes_world():
    mesh = MeshSpec(world_size=64, ranks_per_node=8, shard_size=64)
    assert shard_sizes(mesh) == (1, 2, 4, 8, 16, 32, 64)
    assert dp_shard_sizes(mesh) == (64, 32, 16, 8)
    assert dp_shard_sizes(MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)) == (8,)


def test_search_tries_hsdp_when_the_world_spans_nodes():
    g = _graph("llama-tiny")
    mesh = MeshSpec(world_size=64, ranks_per_node=8, shard_size=64)
    sim = _sim(g, 64)
    res = search_plan(g, sim, mesh)
    shards = {s.plan.mesh.shard_size for s in res.candidates if s.plan.label.startswith("dp")}
    assert {64, 8} <= shards
    # The fastest HSDP answer is at least as fast as FSDP over the world here (tiny model, slow inter-node links).
    assert res.best.plan.mesh.shard_size < 64
    fixed = search_plan(g, sim, mesh, options=SearchOptions(shard_sizes=(64,)))
    assert {s.plan.mesh.shard_size for s in fixed.candidates if s.plan.label.startswith("dp")} == {64}


# --- the search space ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny", "llama-7b"])
def test_space_expresses_every_baseline_and_dp_answer(name):
    g = _graph(name)
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    space = SearchSpace(g, mesh)
    plans = list(baselines(g, mesh).values())
    plans += [p for s in (16, 8) for _, p, _ in dp_plans(
        _sim(g, 16), MeshSpec(world_size=16, ranks_per_node=8, shard_size=s), g.block_chains, memory_budget=math.inf)]
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
    for plan in _random_plans(g, mesh, 300, seed=11):
        _check_conforms(g, plan, None)


def test_random_space_points_are_legal_on_every_zoo_model():
    for name in ("gpt-tiny", "t5-tiny", "vit-tiny"):
        g = _graph(name)
        mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
        for plan in _random_plans(g, mesh, 100, seed=1):
            _check_conforms(g, plan, None)


# --- an infeasible budget --------------------------------------------------------------------------


def test_infeasible_budget_says_what_would_fit():
    g = _graph("llama-7b")
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    sim = _sim(g, 8)
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
