"""evaluation/memtrack.py: ``steady_step_peak`` keeps stepping until a step's allocator
events balance and reports that step's peak ([Note: missed frees])."""

from __future__ import annotations

import torch

from wrapopt.evaluation.memtrack import steady_step_peak

MIB = 1 << 20


def test_unbalanced_steps_are_passed_over_until_one_balances():
    """A step that leaves 1 MiB alive (as a free the profiler missed would read) and
    peaks 2 MiB higher, four times, then balanced steps: the reported peak is a
    balanced one's, found past the first ``tries``, and never the inflated one."""
    model = torch.nn.Linear(4, 4)
    kept: list[torch.Tensor] = []
    calls = [0]

    def step() -> None:
        calls[0] += 1
        if calls[0] <= 4:
            kept.append(torch.empty(MIB, dtype=torch.uint8))
            big = torch.empty(3 * MIB, dtype=torch.uint8)
        else:
            big = torch.empty(MIB, dtype=torch.uint8)
        big.fill_(1)
        del big

    peak = steady_step_peak(step, model, None, "cpu", tries=3, max_tries=8)
    assert calls[0] == 5
    start = sum(p.numel() * p.element_size() for p in model.parameters())
    assert start + MIB <= peak < start + 2 * MIB


def test_it_stops_at_max_tries_with_the_best_balanced_step():
    model = torch.nn.Linear(4, 4)
    kept: list[torch.Tensor] = []
    calls = [0]

    def step() -> None:
        calls[0] += 1
        kept.append(torch.empty(MIB * (3 if calls[0] == 2 else 1), dtype=torch.uint8))

    peak = steady_step_peak(step, model, None, "cpu", tries=2, max_tries=4)
    assert calls[0] == 4
    start = sum(p.numel() * p.element_size() for p in model.parameters())
    assert start + MIB <= peak < start + 2 * MIB  # the smallest imbalance, not the 3 MiB step
