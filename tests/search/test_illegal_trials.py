"""A study never aborts because one trial's plan is illegal: the trial is pruned and
counted (See [Note: illegal trials] in search/study/run.py)."""

from __future__ import annotations

from tests.search.common import zoo_graph
from wrapopt.cost import Simulator
from wrapopt.errors import PlanError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.search.study.space import SearchSpace
from wrapopt.spec import MeshSpec, PlanSpec, UnitSpec
from wrapopt.units import validate_plan


def test_a_trial_validate_plan_refuses_is_pruned_and_counted(monkeypatch):
    g = zoo_graph("gpt-tiny")  # wte and lm_head share their weight
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    sim = Simulator(g, analytical_fabric(world_size=8), analytical_compute())
    suggest = SearchSpace.suggest
    split: list[int] = []

    def every_third_splits_the_tie(self, trial, label=""):
        plan = suggest(self, trial, label)
        if trial.number % 3 == 1:
            split.append(trial.number)
            return PlanSpec((UnitSpec(("wte",)),) + plan.units[-1:], plan.mesh)
        return plan

    monkeypatch.setattr(SearchSpace, "suggest", every_third_splits_the_tie)
    bad = PlanSpec((UnitSpec(("wte",)), UnitSpec(("",), False)), mesh)
    try:
        validate_plan(g, bad)
        raise AssertionError("splitting wte from lm_head must be illegal")
    except PlanError:
        pass
    res = search_plan(g, sim, mesh, options=SearchOptions(trials=12, seed=0))
    study = res.study
    assert len(split) == 4 and study.num_illegal == 4
    assert study.num_trials == 12 - 4  # the others completed; the budget of 12 was spent, not exceeded
    assert any("4 illegal plan(s) proposed by optuna skipped" in n for n in res.notes), res.notes
    assert all(s.plan.units[0].modules != ("wte",) for s in res.candidates)
