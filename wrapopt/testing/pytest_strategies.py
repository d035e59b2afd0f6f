"""The conformance suite every search strategy must pass.

Run it from the strategy's test file: import everything, and override the
``strategy`` fixture (and, if the strategy needs them, ``search_options`` and
``case``)::

    # tests/test_my_strategy.py
    import pytest
    from wrapopt.testing.pytest_strategies import *  # noqa: F401,F403

    @pytest.fixture
    def strategy():
        return MyStrategy()

The checks, on small zoo models traced on the meta device (see ``CASES``):

* every plan it proposes is legal (``validate_plan``), lists each module in
  one unit only, so that every parameter is in exactly one unit, and keeps
  each group of tied parameters in one unit;
* the plans it scored itself carry the simulator's own estimates;
* run alone by ``search_plan``: with a budget that admits every plan it
  proposes without one, the answer fits; with any budget, the answer's
  predicted peak is within the budget, or the search raises
  ``InfeasibleError`` (never a plan over the budget);
* the same problem and seed give the same proposal.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import pytest

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.search.driver import search_plan
from wrapopt.search.strategy import History, Proposal, Scored, SearchOptions, Strategy, make_problem
from wrapopt.spec import ROOT, MeshSpec, ModelGraph, PlanSpec
from wrapopt.trace.meta import trace_model
from wrapopt.units import ancestors, validate_plan

__all__ = [
    "CASES",
    "Case",
    "make_case",
    "strategy",
    "search_options",
    "case",
    "test_proposes_plans_of_the_problem",
    "test_every_parameter_in_exactly_one_unit",
    "test_tied_parameters_share_a_unit",
    "test_own_scores_are_the_simulators",
    "test_budget_that_admits_every_plan_is_met",
    "test_budget_is_met_or_infeasible",
    "test_nothing_fits_one_byte",
    "test_deterministic_for_a_seed",
]

# (zoo model, world size, ranks per node): tied embeddings on one node; two
# chains (encoder, decoder) and a world over eight nodes (HSDP shard groups).
CASES = (("gpt-tiny", 2, 2), ("t5-tiny", 64, 8))


@dataclass(frozen=True)
class Case:
    """A search problem's inputs: a traced model, a mesh (FSDP over the world) and an analytical simulator."""

    name: str
    graph: ModelGraph
    mesh: MeshSpec
    sim: Simulator


@lru_cache(maxsize=None)
def make_case(name: str, world_size: int, ranks_per_node: int) -> Case:
    """A zoo model traced on meta, FSDP over ``world_size`` ranks, analytical profiles (cached)."""
    model, inputs = zoo.build(name, "meta")
    graph = trace_model(model, inputs, loss_fn=zoo.ZOO[name].loss)
    mesh = MeshSpec(world_size=world_size, ranks_per_node=ranks_per_node, shard_size=world_size)
    sim = Simulator(graph, analytical_fabric(world_size=world_size, ranks_per_node=ranks_per_node),
                    analytical_compute())
    return Case(f"{name}-w{world_size}", graph, mesh, sim)


@pytest.fixture
def strategy() -> Strategy:
    """The strategy under test: override this fixture in the strategy's test file."""
    pytest.fail("override the `strategy` fixture: return an instance of the Strategy under test")


@pytest.fixture
def search_options() -> SearchOptions:
    """Options for every search of the suite: a short study, so that an optimiser has trials to run."""
    return SearchOptions(trials=16, seed=0)


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-w{c[1]}")
def case(request) -> Case:
    return make_case(*request.param)


def _propose(strategy: Strategy, case: Case, options: SearchOptions, budget: float | None = None) -> Proposal:
    problem = make_problem(case.graph, case.sim, case.mesh, memory_budget=budget, options=options)
    proposal = strategy.propose(problem, History())
    assert isinstance(proposal, Proposal), f"{strategy!r}.propose returned {type(proposal).__name__}, not a Proposal"
    return proposal


def _all_plans(proposal: Proposal) -> list[PlanSpec]:
    return list(proposal.plans) + [s.plan for s in proposal.evaluated]


def _scored_alone(strategy: Strategy, case: Case, options: SearchOptions) -> list[Scored]:
    """The strategy's plans without a budget, scored by the simulator."""
    return [Scored(p, case.sim.simulate(p), True) for p in _all_plans(_propose(strategy, case, options))]


def _module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ROOT


def _owner(param: str, listed: dict[str, int]) -> int:
    return next(listed[a] for a in ancestors(_module_of(param)) if a in listed)


def test_proposes_plans_of_the_problem(strategy: Strategy, case: Case, search_options: SearchOptions) -> None:
    for plan in _all_plans(_propose(strategy, case, search_options)):
        assert isinstance(plan, PlanSpec)
        validate_plan(case.graph, plan)
        assert (plan.mesh.world_size, plan.mesh.ranks_per_node) == (case.mesh.world_size, case.mesh.ranks_per_node), (
            f"{plan.label}: a plan for another world ({plan.mesh})")


def test_every_parameter_in_exactly_one_unit(strategy: Strategy, case: Case, search_options: SearchOptions) -> None:
    params = [fqn for fqn, _shape, _dtype in case.graph.param_shapes]
    for plan in _all_plans(_propose(strategy, case, search_options)):
        listed: dict[str, int] = {}
        for i, unit in enumerate(plan.units):
            for m in unit.modules:
                assert m in case.graph.tree, f"{plan.label}: unit {i} names {m!r}, not a module of the model"
                assert m not in listed, f"{plan.label}: {m!r} is in units {listed[m]} and {i}"
                listed[m] = i
        assert plan.units[-1].modules == (ROOT,), f"{plan.label}: the root unit must come last"
        # A parameter belongs to the unit of the innermost listed module above it; that
        # unit must list no other module above it (FSDP2 would manage it twice).
        for p in params:
            above = [listed[a] for a in ancestors(_module_of(p)) if a in listed]
            owner = above[0]
            assert owner == len(plan.units) - 1 or above.count(owner) == 1, (
                f"{plan.label}: parameter {p} is under two modules of unit {owner}")


def test_tied_parameters_share_a_unit(strategy: Strategy, case: Case, search_options: SearchOptions) -> None:
    for plan in _all_plans(_propose(strategy, case, search_options)):
        listed = {m: i for i, u in enumerate(plan.units) for m in u.modules}
        for group in case.graph.tied_groups:
            owners = {p: _owner(p, listed) for p in group}
            assert len(set(owners.values())) == 1, f"{plan.label}: tied parameters split across units {owners}"


def test_own_scores_are_the_simulators(strategy: Strategy, case: Case, search_options: SearchOptions) -> None:
    for s in _propose(strategy, case, search_options).evaluated:
        est = case.sim.simulate(s.plan)
        assert (s.estimate.step_s, s.estimate.peak_bytes) == (est.step_s, est.peak_bytes), s.plan.label


def test_budget_that_admits_every_plan_is_met(strategy: Strategy, case: Case, search_options: SearchOptions) -> None:
    scored = _scored_alone(strategy, case, search_options)
    if not scored:
        pytest.skip(f"{strategy.name} proposes nothing for {case.name}")
    budget = max(s.estimate.peak_bytes for s in scored)
    res = search_plan(case.graph, case.sim, case.mesh, memory_budget=budget, options=search_options,
                      strategies=(strategy,))
    assert res.best.fits and res.best.estimate.peak_bytes <= budget


def test_budget_is_met_or_infeasible(strategy: Strategy, case: Case, search_options: SearchOptions) -> None:
    peaks = sorted(s.estimate.peak_bytes for s in _scored_alone(strategy, case, search_options))
    if not peaks:
        pytest.skip(f"{strategy.name} proposes nothing for {case.name}")
    for budget in sorted({peaks[0], peaks[len(peaks) // 2], 0.9 * peaks[0]}):
        try:
            res = search_plan(case.graph, case.sim, case.mesh, memory_budget=budget, options=search_options,
                              strategies=(strategy,))
        except InfeasibleError:
            continue
        assert res.best.estimate.peak_bytes <= budget
        assert all(s.estimate.peak_bytes <= budget for s in res.candidates if s.fits)


def test_nothing_fits_one_byte(strategy: Strategy, case: Case, search_options: SearchOptions) -> None:
    with pytest.raises(InfeasibleError):
        search_plan(case.graph, case.sim, case.mesh, memory_budget=1, options=search_options, strategies=(strategy,))


def test_deterministic_for_a_seed(strategy: Strategy, case: Case, search_options: SearchOptions) -> None:
    runs = [_propose(strategy, case, search_options) for _ in range(2)]
    first, second = ([(s.plan, s.estimate.step_s, s.estimate.peak_bytes) for s in r.evaluated] for r in runs)
    assert runs[0].plans == runs[1].plans
    assert first == second
