"""search: the fastest plan under a memory budget, with the baselines beside it."""

from wrapopt.search.baselines import BASELINE_NAMES, baselines, make_plan
from wrapopt.search.driver import DEFAULT_TRIALS, Scored, SearchOptions, SearchResult, search_plan

__all__ = ["search_plan", "SearchOptions", "SearchResult", "Scored", "DEFAULT_TRIALS", "baselines", "make_plan",
           "BASELINE_NAMES"]
