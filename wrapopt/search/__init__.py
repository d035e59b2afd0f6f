"""search: the fastest plan under a memory budget, with the baselines beside it.

A search runs the registered strategies (``registry.STRATEGIES``: baselines,
the exact DP, uniform groupings, smallest-memory plans, baselines on other
shard groups, the Optuna study); see [Note: search strategies] in ``strategy.py``.
"""

from wrapopt.search.baselines import BASELINE_NAMES, baselines, make_plan
from wrapopt.search.driver import SearchResult, search_plan
from wrapopt.search.registry import STRATEGIES, get_strategy
from wrapopt.search.strategy import (
    DEFAULT_TRIALS,
    History,
    Proposal,
    Round,
    Scored,
    SearchOptions,
    SearchProblem,
    Strategy,
)

__all__ = ["search_plan", "SearchOptions", "SearchResult", "Scored", "DEFAULT_TRIALS", "baselines", "make_plan",
           "BASELINE_NAMES", "Strategy", "SearchProblem", "Proposal", "History", "Round", "STRATEGIES", "get_strategy"]
