"""Which rank failed: the reports of ``launch.spawn``'s ranks, collected and explained.

``wait_for_ranks`` reads each rank's report (a result or an error) from the queue
the ranks share until all have finished or one has failed, and returns the failure
as one first line naming the rank at fault, then the reporting rank's traceback:
See [Note: naming the rank at fault]. Starting and stopping the ranks is
``launch.py``'s. ``lost_peers`` is the survivors' side: a rank whose collective failed
names the peers it lost (See [Note: survivors name the lost rank]).
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import time
from queue import Empty
from typing import Any

from wrapopt.errors import DistributedError

__all__ = ["wait_for_ranks", "is_symptom", "explain_failure", "register_rank", "lost_peers", "lost_rank_error",
           "STOPPED_LIMIT_S", "PROBE_S"]

# [Note: naming the rank at fault]
# The rank that reports an error is often not the one at fault. A rank that dies (OOM killer,
# os._exit, segfault) sends nothing; a rank that hangs (an endless loop, a collective the others
# never enter) sends nothing either. Its peers then fail inside a collective with a *symptom*:
# "Connection reset by peer" or "Timed out waiting 5000ms". So the first line of the error names,
# in this order: a rank that raised something other than a symptom (the cause); else the ranks
# that exited without reporting ("died with exit code N"); else, when the report is a symptom,
# the ranks still alive that never reported ("did not respond (hung?)"); then the reporting rank
# and the first line of its error. Its traceback follows on the next lines.
# A rank killed by a signal is named with it ("was killed by SIGKILL"). A rank stopped by SIGSTOP
# (state T in /proc/PID/stat) cannot report nor time out: the launcher names it once it has
# stayed stopped for ``STOPPED_LIMIT_S`` (``spawn(stopped_limit_s=)``), without waiting for the
# collective timeout, and kills every rank (SIGKILL ends a stopped process too).

STOPPED_LIMIT_S = 10.0  # how long a rank may stay stopped (SIGSTOP) before the launcher gives up on it

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


# What ``lost_peers`` says, in a ``DistributedError`` from ``launch.naming_lost_ranks``: a survivor's
# report, as much a symptom as the gloo error it names.
_LOST = re.compile(r"^(rank \d+ \(pid \d+\) (is gone|was stopped)|rank \d+ did not answer|the process group's store)")


def is_symptom(payload: str) -> bool:
    kind, _, message = payload.partition("\n")[0].partition(": ")
    if kind == "DistributedError":
        return bool(_LOST.match(message))
    return kind in _SYMPTOM_TYPES and bool(_SYMPTOM.search(message))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _died(rank: int, exitcode: int) -> str:
    if exitcode == 0:
        return f"rank {rank} exited with code 0"
    if exitcode < 0:  # multiprocessing's exit code for a process a signal ended
        return f"rank {rank} was killed by {_signal_name(-exitcode)}"
    return f"rank {rank} died with exit code {exitcode}"


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (R, S, D, T stopped, Z zombie, ...) from /proc;
    None where there is no /proc entry (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    _, _, rest = stat.rpartition(")")  # the command name, in parentheses, may hold anything
    return rest.split()[0] if rest.split() else None


def _stopped(procs: list[Any], ranks: list[int]) -> list[int]:
    return [r for r in ranks if procs[r].exitcode is None and process_state(procs[r].pid) == "T"]


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
    stopped = _stopped(procs, silent)
    if dead:
        culprit = "; ".join(_died(r, procs[r].exitcode) for r in dead)
    elif stopped:
        culprit = f"{_ranks(stopped)} {'was' if len(stopped) == 1 else 'were'} stopped (SIGSTOP?) and could not answer"
    elif silent:
        culprit = f"{_ranks(silent)} did not respond (hung?)"
    else:  # every rank reported a symptom: nobody to blame but the reporter
        return f"rank {rank} failed: {errors[rank]}"
    return f"{culprit}; rank {rank} then failed: {head}\n{rest}"


def wait_for_ranks(procs: list[Any], queue: Any, results: dict[int, Any], errors: dict[int, str], *,
                   timeout_s: float, stopped_limit_s: float = STOPPED_LIMIT_S) -> str | None:
    """Collect the ranks' reports into ``results`` and ``errors`` until all have finished or one
    failed; returns the failure, explained (See [Note: naming the rank at fault]), or None.
    A rank stopped (SIGSTOP) for ``stopped_limit_s`` is a failure."""
    world_size = len(procs)
    limit_s = timeout_s + 30.0  # start-up slack on top of the collective timeout
    deadline = time.monotonic() + limit_s
    stopped_since: dict[int, float] = {}
    failure: str | None = None
    while len(results) < world_size and failure is None:
        try:
            rank, status, payload = queue.get(timeout=0.2)
        except Empty:
            failure = _after_silence(procs, queue, results, errors, deadline=deadline, limit_s=limit_s)
            if failure is None:
                failure = _after_stop(procs, queue, results, errors, stopped_since, stopped_limit_s)
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
        if not errors and any(r not in results for r in exited):
            _await_survivors(procs, queue, results, errors)
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


def _await_survivors(procs: list[Any], queue: Any, results: dict[int, Any], errors: dict[int, str]) -> None:
    """A rank died without a report: give the ranks still running ``_SYMPTOM_GRACE_S`` to report
    what they saw (their collective fails at once, then they name the lost rank)."""
    deadline = time.monotonic() + _SYMPTOM_GRACE_S
    while time.monotonic() < deadline:
        waiting = [r for r, p in enumerate(procs) if r not in results and r not in errors and p.exitcode is None]
        if not waiting:
            return
        time.sleep(0.1)
        _drain(queue, results, errors)


def _after_stop(procs: list[Any], queue: Any, results: dict[int, Any], errors: dict[int, str],
                since: dict[int, float], limit_s: float) -> str | None:
    """The failure once a rank has stayed stopped (SIGSTOP) for ``limit_s``; None to keep waiting.
    ``since`` holds when each stopped rank was first seen stopped."""
    now = time.monotonic()
    pending = [r for r in range(len(procs)) if r not in results and r not in errors]
    stopped = _stopped(procs, pending)
    for r in list(since):
        if r not in stopped:
            del since[r]  # continued (SIGCONT)
    for r in stopped:
        since.setdefault(r, now)
    late = [r for r in stopped if now - since[r] >= limit_s]
    if not late:
        return None
    _drain(queue, results, errors)
    failure = (f"{_ranks(late)} {'was' if len(late) == 1 else 'were'} stopped (SIGSTOP?) for {limit_s:g} s and "
               "cannot answer; all ranks were killed")
    others = {r: e for r, e in errors.items() if r not in late}
    if others:
        failure += "\n" + explain_failure(procs, results, others)
    return failure


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


# [Note: survivors name the lost rank]
# A rank whose collective fails sees only gloo's or NCCL's symptom ("Connection closed by peer",
# "Timed out waiting"). To name the peer it lost it asks the process group's own store (TCPStore,
# hosted by rank 0 under ``spawn``, by the agent under ``torchrun``), which lives apart from the
# collectives: at start every rank records "host pid" under ``wrapopt/rank/R`` (``register_rank``,
# one write); after a failure a survivor writes ``wrapopt/alive/R`` and, for up to ``PROBE_S``,
# looks at the others: a peer that writes its own ``alive`` key is a fellow survivor; one on this
# host whose process is gone, a zombie or stopped (SIGSTOP) is lost (a killed process still runs
# for a moment after its sockets close, hence the looking again); one that does neither in time
# is named as not answering. The store is asked with a timeout of ``PROBE_S``, so a store whose
# host was lost (rank 0 under ``spawn``) answers with an error, which is itself the answer. A
# killed peer is named as soon as the collective fails; a stopped one after the process group's
# timeout (a stopped rank breaks no connection). The probe runs only after a failure: a run that
# works pays one write. Under torchrun the agent also sees a child's exit, names it in its summary
# and sends the survivors SIGTERM, so a survivor's own line may not get out first.

PROBE_S = 5.0  # how long a survivor waits for its peers' answers after a failed collective
_RANK_KEY = "wrapopt/rank/{}"
_ALIVE_KEY = "wrapopt/alive/{}"


def _store() -> Any:
    """The default process group's store, or None where there is none (no group, the fake backend)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "fake":
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 (no store to ask: the caller says nothing more)
        return None


def register_rank() -> None:
    """Record this rank's host and pid in the store, for survivors to check: See
    [Note: survivors name the lost rank]. Call on every rank after ``init_process_group``."""
    import torch.distributed as dist

    store = _store()
    if store is not None:
        try:
            store.set(_RANK_KEY.format(dist.get_rank()), f"{socket.gethostname()} {os.getpid()}")
        except Exception:  # noqa: BLE001 (naming lost ranks is a courtesy; never fail a run for it)
            pass


def _judge_local(pid: int) -> str | None:
    """What became of a process on this host: "is gone", "was stopped (SIGSTOP?)", or None (running)."""
    state = process_state(pid)
    if state in (None, "Z", "X"):
        return "is gone (killed or crashed)"
    if state == "T":
        return "was stopped (SIGSTOP?)"
    return None


def lost_peers(*, probe_s: float = PROBE_S) -> str | None:
    """After a failed collective: one clause naming the peers this rank lost, or None when all
    answer or there is no process group. See [Note: survivors name the lost rank]."""
    import torch.distributed as dist

    store = _store()
    if store is None:
        return None
    me, world = dist.get_rank(), dist.get_world_size()
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    host = socket.gethostname()
    saved = store.timeout
    try:
        # The group's own connection: a clone would connect anew, and a client retries a lost
        # server for the whole timeout. Its timeout is the group's again when done.
        store.set_timeout(datetime.timedelta(seconds=probe_s))
        store.set(_ALIVE_KEY.format(me), "1")
        pids: dict[int, int] = {}  # peers on this host, judged by their process too
        lost: dict[int, str] = {}
        waiting = [r for r in range(world) if r != me]
        deadline = time.monotonic() + probe_s
        while waiting:
            for r in waiting:
                if r not in pids and store.check([_RANK_KEY.format(r)]):
                    who, _, pid = store.get(_RANK_KEY.format(r)).decode().partition(" ")
                    pids[r] = int(pid) if who == host and pid.isdigit() else -1
                verdict = _judge_local(pids[r]) if pids.get(r, -1) > 0 else None
                if verdict is not None:
                    lost[r] = f"rank {r} (pid {pids[r]}) {verdict}"
            # a dying process still runs for a moment after its sockets close: look again until it
            # is gone, or it answers as a survivor, or the time is up
            waiting = [r for r in waiting if r not in lost and not store.check([_ALIVE_KEY.format(r)])]
            if waiting and time.monotonic() >= deadline:
                lost.update({r: f"rank {r} did not answer within {probe_s:g} s (lost, or still waiting elsewhere)"
                             for r in waiting})
                break
            if waiting:
                time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 (an unreachable store is the finding)
        why = (str(e).splitlines() or [type(e).__name__])[0][:120]
        return (f"the process group's store at {where} stopped answering ({why}): the process hosting it was lost "
                "(rank 0 under wrapopt's spawn, the agent under torchrun)")
    finally:
        try:
            store.set_timeout(saved)
        except Exception:  # noqa: BLE001 (a lost store keeps whatever timeout it has)
            pass
    return "; ".join(lost[r] for r in sorted(lost)) or None


def lost_rank_error(err: BaseException) -> Exception | None:
    """For an error a collective raised on this rank: a ``DistributedError`` that first names the
    peers lost (``lost_peers``), then this error; None when it is not a lost peer's symptom."""
    import torch.distributed as dist

    if isinstance(err, DistributedError) or not isinstance(err, Exception):
        return None  # wrapopt's own errors already say who failed
    first = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    lost = lost_peers() if is_symptom(first) else None
    if lost is None:
        return None
    return DistributedError(f"{lost}; rank {dist.get_rank()} then failed: {first}")
