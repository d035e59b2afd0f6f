"""launch.spawn: results by rank, and a DistributedError naming the rank at fault.

Each spawn costs a few seconds, so there is one spawn per outcome: a normal
run, a rank that raises, a rank that dies, a rank that hangs. No assertion
here is about wall time (see STYLE.md); the timeouts only stop a broken
``spawn`` from hanging the suite.
"""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from wrapopt.errors import DistributedError
from wrapopt.launch import spawn

pytestmark = pytest.mark.multiprocess

# --- workers: module-level, so the 'spawn' start method can import them ----------------------


def _ok_worker(rank: int, world: int, tag: str) -> dict:
    box = [rank]
    dist.broadcast_object_list(box, src=1)  # a collective really ran
    return {"rank": rank, "world": world, "tag": tag, "from_rank_1": box[0]}


def _raising_worker(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("bad batch size 0 on purpose")
    dist.barrier()  # rank 0 sees rank 1 vanish: a symptom, not the cause
    return rank


def _dying_worker(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)  # as an OOM-killed rank: no report, no traceback
    dist.barrier()
    return rank


def _hanging_worker(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(60)  # never enters the collective rank 0 waits in
    else:
        dist.barrier()
    return rank


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_results_come_back_by_rank() -> None:
    results = spawn(_ok_worker, world_size=2, args=("t",), timeout_s=60)
    assert results == [{"rank": r, "world": 2, "tag": "t", "from_rank_1": 1} for r in range(2)]


@pytest.mark.timeout(120)
def test_a_rank_that_raises_is_named_with_its_error() -> None:
    with pytest.raises(DistributedError) as info:
        spawn(_raising_worker, world_size=2, timeout_s=60)
    first, *rest = str(info.value).splitlines()
    assert first == "rank 1 failed: ValueError: bad batch size 0 on purpose"
    assert any("_raising_worker" in line for line in rest)  # rank 1's traceback follows


@pytest.mark.timeout(120)
def test_a_rank_that_dies_is_named_with_its_exit_code() -> None:
    with pytest.raises(DistributedError) as info:
        spawn(_dying_worker, world_size=2, timeout_s=60)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 died with exit code 3"), first


@pytest.mark.timeout(120)
def test_a_rank_that_hangs_is_named_not_only_the_peer_that_timed_out() -> None:
    with pytest.raises(DistributedError) as info:
        spawn(_hanging_worker, world_size=2, timeout_s=5)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 did not respond (hung?); rank 0 then failed:"), first
    assert "timed out" in first.lower()
