"""benchmarks/fidelity_pp.py's ``--pin stages``: where ranks outnumber cores, consecutive ranks
(a pipeline stage's) share one core, and every thread of the rank is pinned, the ones started
before the pinning too; with a core per rank nothing is pinned. Run in a child process, so the
test's own process keeps its cores: a forked one (pin_stage_cores makes only os calls), which starts
at once where a spawned one imported torch again (seconds of CPU for each of the three)."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from benchmarks.fidelity_pp import pin_stage_cores

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")]


def _child(rank: int, world: int, queue) -> None:
    started, stop = threading.Event(), threading.Event()
    tid: list[int] = []

    def idle() -> None:
        tid.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    t = threading.Thread(target=idle)
    t.start()
    started.wait(30)
    pinned = pin_stage_cores(rank, world)
    queue.put((pinned, sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(tid[0]))))
    stop.set()
    t.join()


def _run(rank: int, world: int):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=_child, args=(rank, world, queue))
    p.start()
    try:
        return queue.get(timeout=60)
    finally:
        p.join(60)


def test_a_stage_shares_one_core_and_every_thread_is_pinned():
    cores = sorted(os.sched_getaffinity(0))
    world = 2 * len(cores)  # two ranks per core, as 4 ranks on this 2-core machine
    for rank, core in ((1, cores[0]), (world - 1, cores[-1])):  # rank 1 on rank 0's core
        pinned, main_thread, other_thread = _run(rank, world)
        assert pinned == main_thread == other_thread == [core], rank


def test_a_core_per_rank_pins_nothing():
    cores = sorted(os.sched_getaffinity(0))
    pinned, main_thread, _ = _run(0, len(cores))
    assert pinned is None and main_thread == cores
