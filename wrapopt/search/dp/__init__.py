"""search.dp: exact dynamic programming over contiguous groupings of block chains."""

from wrapopt.search.dp.solve import ChainDP

__all__ = ["ChainDP"]
