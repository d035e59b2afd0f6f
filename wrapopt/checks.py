"""Checks of the numbers a user gives: counts and positive amounts, where they enter.

[Note: numbers where they enter] A count (ranks, ranks per node, batch, sequence
length, trials, repeats, micro-batches) or an amount (seconds, bytes) is checked
where it enters wrapopt: the CLI's argparse ``type=`` functions (``cli/options.py``),
the API's arguments (``api.py``, ``MeshSpec``) and the readers of files
(``fileio.JsonReader``). A bad value is an ``OptionError`` naming the option and
what it accepts; nothing is clamped, and nothing falls back to a default: a
default applies only when the value is absent (``x is None``, never ``x or
default``, which turns 0 into the default).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from wrapopt.errors import OptionError

__all__ = ["check_count", "check_amount", "check_seed", "MAX_SEED"]


# Optuna's samplers seed numpy, which takes seeds below 2**32.
MAX_SEED = 2**32 - 1


def check_count(value: Any, name: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` if it is an integer of at least ``minimum`` (and at most ``maximum``), else
    ``OptionError`` naming ``name``.

    Example:
        >>> check_count(8, "world_size")
        8
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum or (
            maximum is not None and value > maximum):
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        if maximum is not None:
            what = f"an integer from {minimum} to {maximum}"
        raise OptionError(f"{name} must be {what}, got {value!r}")
    return value


def check_seed(value: Any, name: str = "seed") -> int:
    """A sampler seed: an integer from 0 to ``MAX_SEED``."""
    return check_count(value, name, minimum=0, maximum=MAX_SEED)


def check_amount(value: Any, name: str, *, unit: str, zero: bool = False) -> float:
    """``value`` as a float if it is a finite number above 0 (or 0 with ``zero``), else
    ``OptionError`` naming ``name`` and its ``unit``.

    Example:
        >>> check_amount(1.5, "timeout", unit="seconds")
        1.5
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        what = "a finite number of at least 0" if zero else "a finite number above 0"
        raise OptionError(f"{name} must be {what} ({unit}), got {value!r}")
    return float(value)
