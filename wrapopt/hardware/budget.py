"""The memory budget: given, or the device's capacity with headroom ("auto", the default).

One place for how a budget is read (``resolve_budget``) and how it is stated
(``budget_line`` for the terminal, ``budget_source`` for the assumptions block).
"""

from __future__ import annotations

from typing import Any

from wrapopt.errors import ModelError
from wrapopt.fileio import fmt_bytes, given_budget
from wrapopt.hardware.profiles import ComputeProfile

__all__ = ["MEMORY_HEADROOM", "auto_memory_budget", "budget_line", "budget_source", "resolve_budget"]

MEMORY_HEADROOM = 0.90  # the default budget (`--memory auto`): 90% of the device, the rest left to the allocator


def budget_line(memory_budget: Any, compute: ComputeProfile, budget: float | None) -> str:
    """One line saying where the budget came from."""
    cap = compute.memory_capacity_bytes
    if budget is None:
        if _is_word(memory_budget, "none"):
            return "memory budget: none (--memory none)"
        return "memory budget: none: the device's capacity is unknown; pass --memory 80GiB"
    if memory_budget is None or _is_word(memory_budget, "auto"):
        return (f"memory budget: {fmt_bytes(budget)} per rank = {MEMORY_HEADROOM:.0%} of the device's {fmt_bytes(cap)} "
                f"({1 - MEMORY_HEADROOM:.0%} left to the allocator; --memory sets another, --memory none no limit)")
    return f"memory budget: {fmt_bytes(budget)} per rank (given)"


def _is_word(v: Any, word: str) -> bool:
    return isinstance(v, str) and v.strip().lower() == word


def auto_memory_budget(compute: ComputeProfile) -> float | None:
    """``--memory auto``: ``MEMORY_HEADROOM`` of the device's capacity, or None when unknown."""
    cap = compute.memory_capacity_bytes
    return cap * MEMORY_HEADROOM if cap else None


def budget_source(memory_budget: int | float | str | None, compute: ComputeProfile) -> str:
    """Where a memory budget came from, as the assumptions block states it."""
    if _is_word(memory_budget, "none"):
        return "none (asked for): every plan fits"
    if memory_budget is None and not compute.memory_capacity_bytes:
        return "none: the device's capacity is unknown, every plan fits"
    if memory_budget is None or _is_word(memory_budget, "auto"):
        return f"auto: {MEMORY_HEADROOM:.0%} of the device's {fmt_bytes(compute.memory_capacity_bytes or 0)}"
    return f"given: {memory_budget}" if isinstance(memory_budget, str) else "given"


def resolve_budget(memory_budget: int | float | str | None, compute: ComputeProfile) -> float | None:
    """A memory budget in bytes from bytes, "80GiB"/"80GB", "auto" (the device's capacity with
    headroom), "none" (no limit) or None: "auto" when the device's capacity is known, else no limit."""
    if _is_word(memory_budget, "none"):
        return None
    if memory_budget is None:
        return auto_memory_budget(compute)
    if _is_word(memory_budget, "auto"):
        b = auto_memory_budget(compute)
        if b is None:
            raise ModelError("--memory auto needs a device capacity; the compute profile has none: give bytes or 80GiB")
        return b
    return given_budget(memory_budget)

