"""Measured training steps for plans: the loop that checks the predictions.

All plans are sharded side by side in one process group and stepped
interleaved (A B C A B C ...) after warm-up, so the machine's noise hits every
plan alike; per repeat the step time is the slowest rank's, and a plan's
figure is the median over repeats. Peak memory comes from one extra step per
plan: ``torch.cuda.max_memory_allocated`` on CUDA, live tensor bytes on CPU
(``memtrack.LiveBytesTracker``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.types import PlanSpec

__all__ = ["Measured", "measure_plans"]


@dataclass(frozen=True, slots=True)
class Measured:
    label: str
    step_s: float  # median over repeats of the slowest rank
    times_s: tuple[float, ...]
    spread: float  # (max - min) / median over repeats
    peak_bytes: int  # max over ranks
    losses: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "step_s": self.step_s, "times_s": list(self.times_s), "spread": self.spread,
                "peak_bytes": self.peak_bytes, "losses": list(self.losses)}


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _step(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple, loss_fn: Callable) -> float:
    loss = loss_fn(model(*inputs), inputs)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def measure_plans(
    build: Callable[[], nn.Module],
    plans: list[PlanSpec],
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any, tuple], torch.Tensor],
    *,
    repeats: int = 5,
    warmup: int = 2,
    lr: float = 1e-3,
    measure_memory: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[Measured]:
    """Run real steps of every plan on the current process group (call on every rank).

    ``build()`` must return the same fresh model on every call (fixed seed).
    """
    from wrapopt.apply import apply_plan
    from wrapopt.memtrack import steady_step_peak

    on_cuda = torch.cuda.is_available()
    models, opts = [], []
    for plan in plans:
        m = build()
        apply_plan(m, plan)
        models.append(m)
        opts.append(torch.optim.AdamW(m.parameters(), lr=lr))
    losses: list[list[float]] = [[] for _ in plans]
    times: list[list[float]] = [[] for _ in plans]
    for r in range(warmup + repeats):
        for i, (m, o) in enumerate(zip(models, opts)):
            dist.barrier()
            if on_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = _step(m, o, inputs, loss_fn)
            if on_cuda:
                torch.cuda.synchronize()
            dt = _max_over_ranks(time.perf_counter() - t0)
            if r >= warmup:
                times[i].append(dt)
            losses[i].append(loss)
        if progress:
            progress(f"bench: round {r + 1}/{warmup + repeats}" + (" (warm-up)" if r < warmup else ""))
    peaks = [0] * len(plans)
    if measure_memory:
        for i, (m, o) in enumerate(zip(models, opts)):
            dist.barrier()
            if on_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                _step(m, o, inputs, loss_fn)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
            else:
                # See [Note: missed frees] in memtrack.py.
                peak = steady_step_peak(lambda: _step(m, o, inputs, loss_fn), m, o, "cpu")
            peaks[i] = int(_max_over_ranks(float(peak)))
    out = []
    for i, plan in enumerate(plans):
        med = statistics.median(times[i])
        out.append(Measured(plan.label, med, tuple(times[i]), (max(times[i]) - min(times[i])) / med if med else 0.0,
                            peaks[i], tuple(losses[i])))
    return out
