"""Quiet ranks (See [Note: quiet ranks] in wrapopt/launch.py): with ``spawn(log_dir=...)``
what a rank prints (Python prints, warnings, raw writes to fd 2 as C++ code does) goes to
its log file and not to the terminal; wrapopt's own lines (``progress.say``) still reach
the terminal, and a rank's error still reaches the parent. The parent's file descriptors
are captured with capfd, so a line that escaped to the terminal would show there."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch.distributed as dist

from wrapopt.errors import DistributedError
from wrapopt.launch import QUIET_ENV, is_spawned_rank, spawn
from wrapopt.progress import say

pytestmark = pytest.mark.multiprocess


def _noise(rank: int) -> None:
    print(f"stray print from rank {rank}")
    print(f"stray stderr line from rank {rank}", file=sys.stderr)
    warnings.warn(f"stray warning from rank {rank}", UserWarning)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, f"raw fd-2 line from rank {rank}\n".encode())  # as Kineto or c10 write


def _noisy_worker(rank: int, world: int) -> dict:
    _noise(rank)
    if rank == 0:
        say("wrapopt's own line")
    dist.barrier()
    return {"spawned": is_spawned_rank(), **{k: os.environ.get(k) for k in QUIET_ENV}}


def _noisy_failing_worker(rank: int, world: int) -> int:
    _noise(rank)
    if rank == 1:
        raise ValueError("bad batch size 0 on purpose")
    dist.barrier()
    return rank


@pytest.fixture
def no_user_settings(monkeypatch):
    for var in QUIET_ENV:  # the user's own settings would win over QUIET_ENV
        monkeypatch.delenv(var, raising=False)


@pytest.mark.timeout(120)
def test_a_quiet_rank_prints_to_its_log_and_wrapopt_lines_to_the_terminal(tmp_path, capfd, no_user_settings):
    capfd.readouterr()
    results = spawn(_noisy_worker, world_size=2, timeout_s=60, log_dir=tmp_path / "logs")
    out, err = capfd.readouterr()
    assert "stray" not in out + err and "raw fd-2" not in out + err, out + err
    assert "wrapopt's own line" in err
    for r in range(2):
        log = (tmp_path / "logs" / f"rank{r}.log").read_text()
        for text in ("stray print", "stray stderr line", "stray warning", "raw fd-2 line"):
            assert f"{text} from rank {r}" in log, log
        assert "wrapopt's own line" not in log
    assert results == [{"spawned": True, **QUIET_ENV}] * 2
    assert all(k not in os.environ for k in QUIET_ENV)  # the parent's environment is as it was


@pytest.mark.timeout(120)
def test_a_quiet_rank_that_raises_is_still_named_and_the_error_says_where_the_logs_are(tmp_path, capfd):
    capfd.readouterr()
    with pytest.raises(DistributedError) as info:
        spawn(_noisy_failing_worker, world_size=2, timeout_s=60, log_dir=tmp_path / "logs")
    message = str(info.value)
    assert message.splitlines()[0] == "rank 1 failed: ValueError: bad batch size 0 on purpose"
    assert str(tmp_path / "logs" / "rank*.log") in message.splitlines()[-1]
    out, err = capfd.readouterr()
    assert "stray" not in out + err
    assert "stray print from rank 1" in (tmp_path / "logs" / "rank1.log").read_text()
