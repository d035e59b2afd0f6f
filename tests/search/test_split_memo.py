"""TPE's split made once per trial (See [Note: TPE's split once per trial]): the same plans as
Optuna's own split, and Optuna's function back in place afterwards."""

from __future__ import annotations

import math

from optuna.samplers._tpe import sampler as tpe

from wrapopt.cost import Simulator
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.models.sources import zoo
from wrapopt.search.study.run import run_study
from wrapopt.search.study.space import SearchSpace
from wrapopt.search.study.split_memo import split_once_per_trial
from wrapopt.spec import MeshSpec
from wrapopt.trace.meta import trace_model


def _study(monkeypatch, memo: bool):
    e = zoo.get_entry("gpt-tiny")
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    sim = Simulator(g, analytical_fabric(world_size=8), analytical_compute())
    if not memo:  # the memo made a no-op: Optuna's split on every parameter
        monkeypatch.setattr(tpe._split_trials, "wrapopt_memo", True, raising=False)
    out = run_study(g, sim, SearchSpace(g, mesh), memory_budget=math.inf, seeds=[], trials=30, seed=3)
    return [(t.number, t.estimate.step_s, t.estimate.peak_bytes, t.plan.units) for t in out.pareto]


def test_the_study_samples_the_same_plans_with_and_without_the_memo(monkeypatch):
    with_memo = _study(monkeypatch, memo=True)
    monkeypatch.undo()
    assert with_memo == _study(monkeypatch, memo=False)


def test_the_split_is_optunas_again_after_the_study_and_a_new_history_is_split_afresh():
    original = tpe._split_trials
    calls = []

    def counting(study, trials, *rest):
        calls.append(len(trials))
        return original(study, trials, *rest)

    tpe._split_trials = counting
    try:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(directions=["minimize", "minimize"])
        for x in range(12):
            study.enqueue_trial({"a": x % 3, "b": x % 4})
        study.optimize(lambda t: (t.suggest_int("a", 0, 2), t.suggest_int("b", 0, 3)), n_trials=12)
        trials = study.get_trials(deepcopy=False)
        with split_once_per_trial():
            assert tpe._split_trials is not counting
            first = tpe._split_trials(study, trials, 3)
            assert tpe._split_trials(study, trials, 3) == first and len(calls) == 1  # same history: once
            tpe._split_trials(study, trials[:-1], 3)
            assert calls == [12, 11]  # another history: split again
            assert first == original(study, trials, 3)
        assert tpe._split_trials is counting
    finally:
        tpe._split_trials = original
