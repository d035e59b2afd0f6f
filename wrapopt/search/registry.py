"""The registered search strategies, in the order ``search_plan`` runs them.

To add a strategy: subclass ``strategy.Strategy``, run the conformance suite
(``wrapopt.testing.pytest_strategies``) from its test file, and add an
instance here. The order matters twice: a plan proposed by two strategies
keeps the first one's score and label, and a strategy sees only the rounds
before it (the Optuna study, last, is seeded from all of them).
"""

from __future__ import annotations

from wrapopt.search.baselines import Baselines, BaselinesOnShardGroups, SmallestMemory
from wrapopt.search.dp.strategy import ExactDP, PerBlockDP
from wrapopt.search.strategy import Strategy
from wrapopt.search.study.strategy import OptunaStudy
from wrapopt.search.uniform import UniformGroupings

__all__ = ["STRATEGIES", "get_strategy"]

STRATEGIES: tuple[Strategy, ...] = (
    Baselines(),
    ExactDP(),
    PerBlockDP(),
    UniformGroupings(),
    SmallestMemory(),
    BaselinesOnShardGroups(),
    OptunaStudy(),
)


def get_strategy(name: str) -> Strategy:
    """The registered strategy called ``name``; ``ValueError`` naming the registered ones otherwise."""
    for s in STRATEGIES:
        if s.name == name:
            return s
    raise ValueError(f"no search strategy named {name!r}; registered: {', '.join(s.name for s in STRATEGIES)}")
