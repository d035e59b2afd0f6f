"""Timing helpers shared by the device measurements: a median, a device sync, a timed loop."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

__all__ = ["median", "sync_for", "time_reps"]


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
