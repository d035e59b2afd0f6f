"""The simulator's estimates and the search's answers on fixed sets are those of the
golden files, byte for byte (see tests/golden/digest.py)."""

from __future__ import annotations

from tests.golden import estimates, heldout, searches
from tests.golden.digest import Entry, differences, failure_message, read_golden


def test_estimates_match_golden():
    diffs = differences(read_golden("estimates"), estimates.entries(estimates.dump()))
    assert not diffs, failure_message("estimates", diffs)


def test_search_answers_match_golden():
    diffs = differences(read_golden("search"), searches.entries(searches.run()))
    assert not diffs, failure_message("search", diffs)


def test_heldout_family_matches_golden():
    diffs = differences(read_golden("heldout"), heldout.entries(heldout.dump()))
    assert not diffs, failure_message("heldout", diffs)


def test_a_failure_names_the_changed_entry_and_its_numbers():
    old = [Entry("a", "0.5", 10, "x"), Entry("b", "1.0", 20, "y"), Entry("c", "1.0", 20, "z")]
    new = [Entry("a", "0.5", 10, "x"), Entry("b", "1.25", 21, "w"), Entry("d", "1.0", 20, "z")]
    msg = failure_message("estimates", differences(old, new))
    assert "changed: b: step_s 1.0 -> 1.25, peak_bytes 20 -> 21" in msg
    assert "missing: c" in msg and "new: d" in msg and "a:" not in msg
    assert "only when this change of numbers is intended" in msg
