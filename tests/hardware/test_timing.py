"""hardware/timing.py: the paired difference, on a fake clock (no wall time is asserted)."""

from __future__ import annotations

import wrapopt.hardware.timing as timing


def test_paired_difference_pairs_each_round_and_alternates_the_order(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    calls = []
    drift = [0.0]  # the machine slows down round after round: pairing cancels it

    def a():
        calls.append("a")
        clock[0] += 3.0 + drift[0]
        drift[0] += 0.5

    def b():
        calls.append("b")
        clock[0] += 1.0 + drift[0]

    d = timing.paired_difference(a, b, repeats=4, warmup=1, sync=lambda: None)
    assert calls[:2] == ["a", "b"]  # warm-up
    assert calls[2:] == ["a", "b", "b", "a", "a", "b", "b", "a"]  # alternating order
    # a's extra is 2 s in every round; the drift between rounds (0.5 s each) never enters a difference,
    # though within a round the later call carries the slowdown a caused: the median of the pairs.
    assert 1.5 <= d <= 2.5
