"""Which rank failed: the reports of ``launch.spawn``'s ranks, collected and explained.

``wait_for_ranks`` reads each rank's report (a result or an error) from the queue
the ranks share until all have finished or one has failed, and returns the failure
as one first line naming the rank at fault, then the reporting rank's traceback:
See [Note: naming the rank at fault]. Starting and stopping the ranks is
``launch.py``'s.
"""

from __future__ import annotations

import re
import time
from queue import Empty
from typing import Any

__all__ = ["wait_for_ranks", "is_symptom", "explain_failure"]

# [Note: naming the rank at fault]
# The rank that reports an error is often not the one at fault. A rank that dies (OOM killer,
# os._exit, segfault) sends nothing; a rank that hangs (an endless loop, a collective the others
# never enter) sends nothing either. Its peers then fail inside a collective with a *symptom*:
# "Connection reset by peer" or "Timed out waiting 5000ms". So the first line of the error names,
# in this order: a rank that raised something other than a symptom (the cause); else the ranks
# that exited without reporting ("died with exit code N"); else, when the report is a symptom,
# the ranks still alive that never reported ("did not respond (hung?)"); then the reporting rank
# and the first line of its error. Its traceback follows on the next lines.

_SYMPTOM_GRACE_S = 1.5  # after a symptom, how long peers stuck in the same collective get to report
# How a peer's death or hang looks from a rank waiting on it: the error types c10d, gloo and NCCL
# raise, with a message about a timeout or a lost connection. A ValueError("timeout must be > 0")
# from user code is a cause, not a symptom.
_SYMPTOM_TYPES = frozenset({
    "RuntimeError", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "OSError",
    "TimeoutError", "ConnectionError", "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError",
})
_SYMPTOM = re.compile(
    r"timed? ?out|timeout|connection (reset|closed|refused|aborted)|reset by peer|broken pipe|socket closed"
    r"|end of file|unreachable|watchdog",
    re.IGNORECASE,
)


def is_symptom(payload: str) -> bool:
    kind, _, message = payload.partition("\n")[0].partition(": ")
    return kind in _SYMPTOM_TYPES and bool(_SYMPTOM.search(message))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _died(rank: int, exitcode: int) -> str:
    return f"rank {rank} exited with code 0" if exitcode == 0 else f"rank {rank} died with exit code {exitcode}"


def _drain(queue: Any, results: dict[int, Any], errors: dict[int, str]) -> None:
    """Move every report already in the queue into ``results`` or ``errors``."""
    while True:
        try:
            rank, status, payload = queue.get_nowait()
        except Empty:
            return
        (results if status == "ok" else errors)[rank] = payload


def explain_failure(procs: list[Any], results: dict[int, Any], errors: dict[int, str]) -> str:
    """One first line naming the likely culprit, then the reporting rank's traceback; see the note above."""
    silent = [r for r in range(len(procs)) if r not in results and r not in errors]
    dead = [r for r in silent if procs[r].exitcode is not None]
    causes = [r for r, e in errors.items() if not is_symptom(e)]
    if causes:
        rank = causes[0]
        return f"rank {rank} failed: {errors[rank]}"
    if not errors:  # exited without a word, e.g. os._exit(3) inside fn before any peer noticed
        return "; ".join(_died(r, procs[r].exitcode) for r in dead) + " before reporting a result"
    rank = next(iter(errors))
    head, _, rest = errors[rank].partition("\n")
    if dead:
        culprit = "; ".join(_died(r, procs[r].exitcode) for r in dead)
    elif silent:
        culprit = f"{_ranks(silent)} did not respond (hung?)"
    else:  # every rank reported a symptom: nobody to blame but the reporter
        return f"rank {rank} failed: {errors[rank]}"
    return f"{culprit}; rank {rank} then failed: {head}\n{rest}"


def wait_for_ranks(procs: list[Any], queue: Any, results: dict[int, Any], errors: dict[int, str], *,
                   timeout_s: float) -> str | None:
    """Collect the ranks' reports into ``results`` and ``errors`` until all have finished or one
    failed; returns the failure, explained (See [Note: naming the rank at fault]), or None."""
    world_size = len(procs)
    limit_s = timeout_s + 30.0  # start-up slack on top of the collective timeout
    deadline = time.monotonic() + limit_s
    failure: str | None = None
    while len(results) < world_size and failure is None:
        try:
            rank, status, payload = queue.get(timeout=0.2)
        except Empty:
            failure = _after_silence(procs, queue, results, errors, deadline=deadline, limit_s=limit_s)
            continue
        (results if status == "ok" else errors)[rank] = payload
        if status == "error":
            failure = _after_error(procs, queue, results, errors, payload)
    return failure


def _after_silence(procs: list[Any], queue: Any, results: dict[int, Any], errors: dict[int, str], *,
                   deadline: float, limit_s: float) -> str | None:
    """No report came: the failure when a rank exited without reporting or one failed, or when
    the deadline passed (the ranks still silent are blamed); None to keep waiting."""
    world_size = len(procs)
    exited = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
    if exited:
        time.sleep(0.5)  # let a report sent just before exiting arrive first
        _drain(queue, results, errors)
        if errors or any(r not in results for r in exited):
            return explain_failure(procs, results, errors)
    elif time.monotonic() > deadline:
        _drain(queue, results, errors)
        missing = [r for r in range(world_size) if r not in results and r not in errors]
        failure = f"{_ranks(missing)} did not report within {limit_s:.0f} s (hung?); all ranks were killed"
        if results:
            failure += f" ({_ranks(sorted(results))} had finished)"
        if errors:
            failure += "\n" + explain_failure(procs, results, errors)
        return failure
    return None


def _after_error(procs: list[Any], queue: Any, results: dict[int, Any], errors: dict[int, str], payload: str) -> str:
    """A rank reported an error: wait for its peers' reports, then explain the failure."""
    time.sleep(0.5)  # peers failing for the same reason report within moments
    _drain(queue, results, errors)
    if is_symptom(payload):
        # Peers stuck in the same collective time out a little later; give them a moment
        # so that only the silent ranks are blamed.
        time.sleep(_SYMPTOM_GRACE_S)
        _drain(queue, results, errors)
    return explain_failure(procs, results, errors)
