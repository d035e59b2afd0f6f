"""search.dp: exact dynamic programming over contiguous groupings of block chains."""

from wrapopt.search.dp.plans import ChainDP, DPAnswer, dp_plans
from wrapopt.search.dp.strategy import ExactDP

__all__ = ["ChainDP", "DPAnswer", "dp_plans", "ExactDP"]
