"""Measure the overlap factors: how much collectives and compute slow each other down when both run.

``measure_overlap_factors()`` runs on every rank of a live process group (``measure_fabric`` calls it)
and returns the same two factors on each: See [Note: overlap factor] in hardware/profiles.py.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from wrapopt.hardware.collective_ops import all_gather_single, barrier

__all__ = ["measure_overlap_factors"]


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def measure_overlap_factors(*, device: torch.device, sync: Callable[[], None], reduce_device: torch.device,
                            target_s: float = 0.03, repeats: int = 3) -> tuple[float, float]:
    """(compute slowdown, collective slowdown) when both run at once, max over ranks; see [Note: overlap factor].

    compute slowdown = t(compute while all-gathers are in flight) / t(compute alone) - 1,
    with the all-gathers sized to outlast the compute so it is covered throughout.
    collective slowdown = t(all-gathers while compute runs) / t(all-gathers alone) - 1,
    with the compute sized to outlast the all-gathers; i.e. how much longer a
    collective takes when the device is busy computing. Both floored at 0.
    The collective is a 4 MiB all-gather on the world group, the compute a
    matmul loop (fp32 256x256 on CPU, bf16 4096x4096 on GPU) of ~``target_s``.
    """
    cuda = device.type == "cuda"
    n, dt = (4096, torch.bfloat16) if cuda else (256, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    c = torch.empty_like(a)
    world = dist.get_world_size()
    full = torch.zeros(2**20 // world * world, device=device)  # ~4 MiB unsharded, fp32
    shard = torch.zeros(full.numel() // world, device=device)

    def gather(k: int, async_op: bool) -> list[Any]:
        return [all_gather_single(full, shard, async_op=async_op) for _ in range(k)]

    def timed(fn: Callable[[], Any], reps: int = repeats) -> float:
        ts = []
        for _ in range(reps):
            barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return _median(ts)

    # Calibrate on one matmul and one all-gather; every rank must agree on the number of all-gathers.
    per = torch.tensor([timed(lambda: torch.mm(a, b, out=c), 5), timed(lambda: gather(1, False), 5)],
                       dtype=torch.float64, device=reduce_device)
    dist.all_reduce(per, op=dist.ReduceOp.MAX)
    steps = max(1, round(target_s / float(per[0])))
    k = max(1, round(target_s / float(per[1])))

    def compute(m: int) -> None:
        for _ in range(m):
            torch.mm(a, b, out=c)

    t_compute = timed(lambda: compute(steps))
    # Issued the same way as under compute (async, then wait): gloo may overlap queued ops.
    t_comm = timed(lambda: [w.wait() for w in gather(k, True)])
    compute_under, comm_under = [], []
    for _ in range(repeats):
        # (a) compute while twice its length of all-gathers is in flight.
        barrier()
        sync()
        works = gather(2 * k, True)
        compute_under.append(_timed_compute(lambda: compute(steps), cuda, sync))
        for w in works:
            w.wait()
        sync()
        # (b) all-gathers while twice their length of compute runs.
        barrier()
        sync()
        comm_under.append(_comm_under_compute(lambda: gather(k, True), lambda: compute(1), 2 * steps, cuda, sync))
    out = torch.tensor([_median(compute_under) / t_compute - 1, _median(comm_under) / t_comm - 1],
                       dtype=torch.float64, device=reduce_device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return max(0.0, float(out[0])), max(0.0, float(out[1]))


def _timed_compute(fn: Callable[[], None], cuda: bool, sync: Callable[[], None]) -> float:
    """Seconds of ``fn``'s own work; on a GPU timed by events on its stream, not by a device sync
    (which would also wait for the collectives in flight)."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / 1e3


def _comm_under_compute(issue: Callable[[], list[Any]], step: Callable[[], None], steps: int,
                        cuda: bool, sync: Callable[[], None]) -> float:
    """Seconds from issuing the collectives to the last one landing, while ``steps`` compute steps run."""
    if cuda:
        # The CPU runs ahead of the GPU, so polling would time the launches; time the landing on a
        # side stream that waits for the collectives while the compute stream stays busy.
        side = torch.cuda.Stream()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        works = issue()
        with torch.cuda.stream(side):
            for w in works:
                w.wait()
            e1.record(side)
        for _ in range(steps):
            step()
        sync()
        return e0.elapsed_time(e1) / 1e3
    t0 = time.perf_counter()
    works = issue()
    landed = None
    for _ in range(steps):
        step()
        # Poll between steps (one step's resolution); gloo may run two queued ops at once, so ask all.
        if landed is None and all(w.is_completed() for w in works):
            landed = time.perf_counter() - t0
    for w in works:
        w.wait()
    return landed if landed is not None else time.perf_counter() - t0
