"""The memory budget a user writes: readable forms become bytes, the rest one error naming
the argument and the accepted forms (issue 33)."""

from __future__ import annotations

import pytest

from wrapopt.errors import OptionError, WrapoptError
from wrapopt.hardware import analytical_compute
from wrapopt.hardware.budget import resolve_budget


@pytest.mark.parametrize("given, want", [("80GiB", 80 * 2**30), ("80GB", 80e9), (1e9, 1e9), (2**30, 2**30)])
def test_readable_budgets_become_bytes(given, want):
    assert resolve_budget(given, analytical_compute()) == want


@pytest.mark.parametrize("given", [float("nan"), float("inf"), -float("inf"), -5, 0, 0.5, "abc", "nan", "inf",
                                   "-3GiB", "1e999", ""])
def test_an_unusable_budget_names_the_argument_and_the_accepted_forms(given):
    with pytest.raises(OptionError) as err:
        resolve_budget(given, analytical_compute())
    msg = str(err.value)
    assert isinstance(err.value, (WrapoptError, ValueError)) and "\n" not in msg
    assert msg.startswith("memory_budget (--memory)") and "80GiB" in msg and '"auto"' in msg and '"none"' in msg
