"""The Optuna study as a search strategy: the general space, seeded with what came before."""

from __future__ import annotations

from wrapopt.search.strategy import History, Proposal, Scored, SearchProblem, Strategy
from wrapopt.search.study.run import run_study
from wrapopt.search.study.space import SearchSpace
from wrapopt.spec import PlanSpec

__all__ = ["OptunaStudy", "study_seeds", "NUM_BEST_SEEDS"]

NUM_BEST_SEEDS = 8  # the fastest fitting plans scored so far that seed the study, beside the seed-every-plan ones


class OptunaStudy(Strategy):
    """A constrained two-objective Optuna study over the general space (see
    [Note: search space], [Note: resumable studies]) of ``options.trials``
    trials with ``options.seed``; nothing when ``trials`` is 0.

    It is seeded with every plan of the earlier strategies that set
    ``seed_every_plan`` (the baselines, the DP's answers), in order, then with
    the ``NUM_BEST_SEEDS`` fastest fitting plans scored so far, so its best is
    never worse than theirs. The study scores its trials itself; its Pareto
    front comes back as ``Proposal.evaluated`` and the ``StudyOutcome`` as
    ``Proposal.detail``.
    """

    name = "optuna"

    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        opts = problem.options
        if opts.trials <= 0:
            return Proposal()
        space = SearchSpace(problem.graph, problem.mesh, shard_choices=opts.shard_sizes,
                            checkpoint_modes=opts.checkpoint_modes)
        study = run_study(problem.graph, problem.sim, space, memory_budget=problem.memory_budget,
                          seeds=study_seeds(history), trials=opts.trials, seed=opts.seed, storage=opts.storage,
                          study_name=opts.study_name, sampler=opts.sampler, timeout_s=opts.timeout_s,
                          progress=opts.progress)
        front = tuple(Scored(t.plan, t.estimate, t.fits, strategy=self.name) for t in study.pareto)
        return Proposal(evaluated=front, detail=study, num_illegal=study.num_illegal)


def study_seeds(history: History) -> list[PlanSpec]:
    """The seeds for an optimiser after ``history``: see ``OptunaStudy``."""
    out = [p for r in history.rounds if r.strategy.seed_every_plan for p in r.proposed]
    rest = sorted((s for s in history.scored if s.fits), key=lambda s: s.estimate.step_s)
    return out + [s.plan for s in rest[:NUM_BEST_SEEDS]]
