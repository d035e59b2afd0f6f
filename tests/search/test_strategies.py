"""Every registered search strategy passes the conformance suite; the driver
loops over strategies it does not know; ``optimize_wrap(seed=)`` seeds the search."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wrapopt import api
from wrapopt.models import zoo
from wrapopt.errors import InfeasibleError
from wrapopt.search import tp as search_tp
from wrapopt.search.driver import search_plan
from wrapopt.search.registry import STRATEGIES, get_strategy
from wrapopt.search.strategy import History, Proposal, SearchOptions, SearchProblem, Strategy
from wrapopt.search.uniform import uniform_plan
from wrapopt.testing.pytest_strategies import *  # noqa: F401,F403
from wrapopt.testing.pytest_strategies import Case, make_case


@pytest.fixture(params=STRATEGIES, ids=lambda s: s.name)
def strategy(request) -> Strategy:
    return request.param


def test_registered_names_are_unique():
    names = [s.name for s in STRATEGIES]
    assert len(set(names)) == len(names)
    assert get_strategy("dp") is STRATEGIES[names.index("dp")]
    with pytest.raises(ValueError, match="registered: baselines"):
        get_strategy("simulated-annealing")


def test_a_strategy_needs_a_name():
    with pytest.raises(TypeError, match="needs a class attribute `name`"):
        class Nameless(Strategy):  # noqa: F841
            def propose(self, problem, history):
                return Proposal()


class _Groups(Strategy):
    """A strategy the registry does not know: uniform groupings of 2 blocks, labelled to look like DP answers."""

    name = "pairs"

    def __init__(self):
        self.seen: list[History] = []

    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        self.seen.append(history)
        plan = uniform_plan(problem.graph, problem.mesh, 2, reshard=True, checkpoint=False)
        return Proposal(plans=(replace(plan, label="dp(reshard=T,ckpt=F)"),))


def _gpt() -> Case:
    return make_case("gpt-tiny", 2, 2)


def test_driver_runs_strategies_it_is_given_and_reads_no_label():
    c = _gpt()
    mine = _Groups()
    res = search_plan(c.graph, c.sim, c.mesh, strategies=(get_strategy("baselines"), mine))
    assert [r.strategy.name for r in res.rounds] == ["baselines", "pairs"]
    assert len(mine.seen) == 1 and [r.strategy.name for r in mine.seen[0].rounds] == ["baselines"]
    assert len(mine.seen[0].scored) == len(res.baselines)  # it saw every baseline scored
    assert res.best_of("pairs").strategy == "pairs"
    assert res.dp_best is None  # a "dp(...)" label does not make a plan a DP answer
    assert res.study is None and res.optuna_best is None


def test_rounds_record_every_strategy_in_registry_order():
    c = make_case("t5-tiny", 64, 8)
    res = search_plan(c.graph, c.sim, c.mesh, options=SearchOptions(trials=8, seed=0))
    assert [r.strategy for r in res.rounds] == list(STRATEGIES)
    dp = res.round("dp")
    assert len(dp.scored) == len(dp.proposed) > 0
    assert res.dp_best == dp.best and res.dp_best.fits
    # Every candidate is attributed to the strategy that proposed it first.
    names = {s.name for s in STRATEGIES}
    assert {s.strategy for s in res.candidates} <= names
    assert all(s.strategy == "optuna" for s in res.round("optuna").scored)
    assert res.study is res.round("optuna").detail and res.study.num_trials == 8
    # A plan proposed again by a later strategy keeps its first score.
    first = {}
    for r in res.rounds:
        for p, s in zip(r.proposed, r.scored):
            first.setdefault((p.units, p.mesh, p.forward_prefetch), s)
            if not r.strategy.reference:
                assert s is first[(p.units, p.mesh, p.forward_prefetch)]


def test_a_strategy_alone_that_proposes_nothing_is_infeasible():
    c = _gpt()
    with pytest.raises(InfeasibleError, match="no search strategy proposed a plan"):
        search_plan(c.graph, c.sim, c.mesh, strategies=(get_strategy("optuna"),))  # trials=0: no study


class _Stop(Exception):
    pass


def test_optimize_wrap_seeds_the_search(monkeypatch):
    seen = []

    def capture(*args, options=None, **kwargs):
        seen.append(options)
        raise _Stop

    monkeypatch.setattr(search_tp, "search_plan", capture)  # the 1-D search of a flat shape (search_shape)
    model, x = zoo.build("gpt-tiny", "meta")
    for seed in (0, 7):
        with pytest.raises(_Stop):
            api.optimize_wrap(model, x, world_size=2, seed=seed, loss_fn=zoo.ZOO["gpt-tiny"].loss)
    assert [(o.seed, o.trials) for o in seen] == [(0, api.DEFAULT_TRIALS), (7, api.DEFAULT_TRIALS)]
