"""Timing helpers shared by the device measurements: a median, a device sync, a timed loop."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

__all__ = ["median", "sync_for", "time_reps", "paired_difference"]


def median(xs: list[float]) -> float:
    """The median (the mean of the middle two for an even count)."""
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def sync_for(device: torch.device) -> Callable[[], None]:
    """Waits for ``device``'s queued work (a CUDA stream); nothing on a CPU."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def time_reps(fn: Callable[[], Any], *, repeats: int, warmup: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``fn`` over ``repeats`` timed calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return median(ts)


def paired_difference(a: Callable[[], Any], b: Callable[[], Any], *, repeats: int, warmup: int,
                      sync: Callable[[], None]) -> float:
    """Median over ``repeats`` rounds of (seconds of ``a`` - seconds of ``b``), the two timed back to back
    in each round, in alternating order. A difference of two medians timed one after the other (minutes
    apart on a shared machine) carries the load's drift between them; a paired one cancels it."""
    for _ in range(warmup):
        a()
        b()
    sync()
    diffs = []
    for r in range(repeats):
        first, second = (a, b) if r % 2 == 0 else (b, a)
        t0 = time.perf_counter()
        first()
        sync()
        t1 = time.perf_counter()
        second()
        sync()
        t2 = time.perf_counter()
        ta, tb = (t1 - t0, t2 - t1) if r % 2 == 0 else (t2 - t1, t1 - t0)
        diffs.append(ta - tb)
    return median(diffs)
