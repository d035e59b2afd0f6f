"""Start and stop process groups without hangs.

``spawn(fn, world_size=2)`` runs ``fn(rank, world_size, *args)`` on that many
local processes with the gloo (CPU) or NCCL (GPU) backend, a free port, one
thread per rank on CPU, a timeout on every collective, and the barrier +
``destroy_process_group()`` ending every rank needs. It returns each rank's
return value, or raises ``DistributedError`` naming the rank that failed,
died or hung (not only the peer that timed out waiting for it; ``rank_faults.py``
reads the ranks' reports and names it); the other ranks are killed, never left
hanging.

``spawn(..., log_dir=DIR)`` keeps the ranks' own output (library warnings,
profiler and C++ log lines, stray prints) off the terminal: See [Note: quiet
ranks].

``init_from_env()`` does the same set-up inside a job started by ``torchrun``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wrapopt.errors import DistributedError, WrapoptError
from wrapopt.progress import set_console
from wrapopt.rank_faults import (STOPPED_LIMIT_S, is_symptom, lost_peers, lost_rank_error, register_rank,
                                 wait_for_ranks)
from wrapopt.spec import MeshSpec

__all__ = ["profiler_log_path", "profiler_lines_to_log", "spawn", "init_from_env", "shutdown", "run_rank_main",
           "free_port", "default_backend", "device_type", "broadcast_json", "is_spawned_rank", "QUIET_ENV", "logs_line",
           "dp_rank_size", "naming_lost_ranks"]

DEFAULT_TIMEOUT_S = 120.0

# [Note: quiet ranks] With ``spawn(log_dir=DIR)`` a rank's output goes to DIR/rank{r}.log, and
# wrapopt's own lines still reach the terminal:
# - first thing in the rank (``_worker``), stdout and stderr are flushed and file descriptors 1
#   and 2 pointed at the log, so C and C++ code writing to them (Kineto, c10, gloo) lands there
#   too, not only Python's ``print`` and ``warnings``; a copy of the old fd 2 becomes
#   ``progress.console()``, where ``progress.say`` and ``Progress`` write;
# - ``QUIET_ENV`` switches two sources off where they start. ``KINETO_LOG_LEVEL=6``: the
#   profiler's "USDT ... profiler_start/stop" lines, read at the first profiler use, so setting
#   it in the rank is early enough (5 does not silence them). ``TORCH_CPP_LOG_LEVEL=ERROR``: c10's
#   "[W ...]" warning lines, read when torch is loaded, which a spawned rank does while it
#   unpickles its target, before ``_worker`` runs; so the parent puts it in the environment the
#   ranks start with. C++ warnings below ERROR are then dropped, not logged. A variable the user
#   set already is left as it is;
# - errors still reach the parent through the result queue, and a failure names the log folder.
# ``log_dir=None`` (``wrapopt -v``) leaves every line on the terminal.
QUIET_ENV = {"KINETO_LOG_LEVEL": "6", "TORCH_CPP_LOG_LEVEL": "ERROR"}
_STARTED_BY_SPAWN = "WRAPOPT_SPAWNED_RANK"  # set in every rank spawn starts


def is_spawned_rank() -> bool:
    """True in a rank started by ``spawn``: its stdout and stderr are where ``spawn`` put them."""
    return os.environ.get(_STARTED_BY_SPAWN) == "1"


def logs_line(log_dir: str | os.PathLike) -> str:
    """The line a command ends with to say where its ranks' own output went."""
    return f"the ranks' own output (library warnings, profiler lines): {os.path.join(os.fspath(log_dir), 'rank*.log')}"


def _output_to_log(rank: int, log_dir: str) -> None:
    """Point this process's fds 1 and 2 at ``log_dir``/rank{rank}.log; keep the terminal as the console."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    set_console(os.fdopen(os.dup(2), "w", buffering=1))
    path = os.path.join(log_dir, f"rank{rank}.log")
    if os.path.islink(path):
        os.unlink(path)  # a link is replaced, never written through (as fileio's atomic writes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in os.environ while the ranks start (they copy it), then as it was."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_from_env(*, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; returns (rank, world size).

    Does nothing if a group already exists. One thread per rank on CPU, so
    ranks sharing a machine do not fight over its cores.
    """
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise DistributedError(
                f"no process group and no torchrun environment (missing {', '.join(missing)}); "
                "start the script with `torchrun --nproc_per_node N script.py`"
            )
        backend = backend or default_backend()
        if backend == "gloo":
            torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        register_rank()  # See [Note: survivors name the lost rank] in wrapopt/rank_faults.py
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def naming_lost_ranks() -> Iterator[None]:
    """Around a rank's collective work: a failure that is a symptom of a lost peer ("Connection
    closed by peer", a timeout) becomes a ``DistributedError`` whose message first names the peer
    lost, then this rank's error. See [Note: survivors name the lost rank] in wrapopt/rank_faults.py.

    Example:
        >>> with naming_lost_ranks():  # no process group: nothing to name
        ...     pass
    """
    try:
        yield
    except Exception as e:
        named = lost_rank_error(e)
        if named is None:
            raise
        raise named from e


def dp_rank_size(mesh: MeshSpec, rank: int | None = None) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of global ``rank`` (default: this process's)
    on a plan's mesh: which share of the global batch a rank trains on.

    The mesh is ``replicate x shard x tp``, row-major, tensor-parallel axis innermost, so
    the ``tp_size`` consecutive ranks of one tensor-parallel group share one data-parallel
    rank, ``rank // tp_size``, of ``world_size // tp_size``; they must be fed the same batch.
    Without tensor parallelism it is ``(rank, world_size)``.

    Example:
        >>> dp_rank_size(MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, tp_size=2), rank=3)
        (1, 2)
    """
    if rank is None:
        if not dist.is_initialized():
            raise DistributedError("dp_rank_size: no process group; pass rank=, or call "
                                   "wrapopt.launch.init_from_env() first")
        rank = dist.get_rank()
        if dist.get_world_size() != mesh.world_size:
            raise DistributedError(f"dp_rank_size: the plan's mesh has {mesh.world_size} ranks but this job has "
                                   f"{dist.get_world_size()}; start {mesh.world_size} ranks or re-run the search")
    if not 0 <= rank < mesh.world_size:
        raise ValueError(f"dp_rank_size: rank {rank} is outside the mesh of {mesh.world_size} ranks")
    return rank // mesh.tp_size, mesh.dp_size


def shutdown() -> None:
    """Barrier, then destroy the group (without the barrier ranks abort at exit now and then).

    Called while an exception is on its way out (in a ``finally``), it skips the barrier: after a
    failed collective the barrier only fails again, or waits the whole timeout for a lost rank,
    and its error would hide the first one."""
    if dist.is_initialized():
        try:
            if sys.exc_info()[1] is None:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def run_rank_main(main: Callable[[], int]) -> None:
    """The ``__main__`` of a script each rank of ``torchrun`` runs: ``main()``, then ``shutdown()``,
    then exit with its code. A ``WrapoptError`` (a bad plan or model: raised on every rank alike,
    See [Note: every rank explains] in consensus.py) is one line naming the rank, no traceback,
    and exit code 1; any other error keeps its traceback."""
    try:
        code = main()
        shutdown()
    except WrapoptError as e:
        print(f"[rank {dist.get_rank() if dist.is_initialized() else '?'}] error: {e}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        code = 1
    sys.exit(code)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    env: dict[str, str],
    log_dir: str | None = None,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
         "LOCAL_RANK": str(rank % int(env.get("LOCAL_WORLD_SIZE", world_size))), }
    )
    try:
        if log_dir is not None:
            _output_to_log(rank, log_dir)  # See [Note: quiet ranks]
        if backend == "gloo":
            torch.set_num_threads(1)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        register_rank()  # See [Note: survivors name the lost rank] in wrapopt/rank_faults.py
        result = fn(rank, world_size, *args)
        shutdown()
        queue.put((rank, "ok", result))
    except BaseException as e:  # report, then let the parent kill the rest
        report = f"{type(e).__name__}: {e}"
        named = isinstance(e, DistributedError)  # naming_lost_ranks, or wrapopt's own words
        lost = lost_peers() if isinstance(e, Exception) and not named and is_symptom(report) else None
        seen = f"rank {rank} saw: {lost}\n" if lost else ""
        queue.put((rank, "error", f"{report}\n{seen}{traceback.format_exc(limit=8)}"))
        raise SystemExit(1)


def spawn(
    fn: Callable[..., Any],
    *,
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    env: dict[str, str] | None = None,
    log_dir: str | os.PathLike | None = None,
    stopped_limit_s: float = STOPPED_LIMIT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return results by rank.

    ``env`` is added to each rank's environment. With ``log_dir`` each rank's
    stdout and stderr go to ``log_dir``/rank{r}.log (the folder is made) and
    only wrapopt's own lines (``progress.say``, ``Progress``) reach the
    terminal; See [Note: quiet ranks].

    ``fn`` must be importable (module-level). Results travel through a
    multiprocessing queue, so keep them small (numbers, dicts, lists).
    A failure raises ``DistributedError`` whose first line names the likely
    culprit; see [Note: naming the rank at fault] in wrapopt/rank_faults.py. A rank killed by a
    signal is named at once, one stopped (SIGSTOP) after ``stopped_limit_s``, one that hangs
    after ``timeout_s`` (the collective timeout of its peers).

    Example:
        >>> def hello(rank, world): return rank
        >>> spawn(hello, world_size=2)  # doctest: +SKIP
        [0, 1]
    """
    backend = backend or default_backend()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    log = None if log_dir is None else os.path.abspath(os.fspath(log_dir))
    procs = _start_ranks(ctx, queue, fn, world_size=world_size, args=args, timeout_s=timeout_s, backend=backend,
                         env=env, log=log)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}  # rank -> "Type: message\ntraceback", in the order reported
    failure: str | None = None
    try:
        failure = wait_for_ranks(procs, queue, results, errors, timeout_s=timeout_s, stopped_limit_s=stopped_limit_s)
    finally:
        _stop_ranks(procs, failed=failure is not None)
    if failure is not None:
        where = f"\n(the ranks' own output is in {os.path.join(log, 'rank*.log')})" if log else ""
        raise DistributedError(failure.rstrip() + where)
    return [results[r] for r in range(world_size)]


def _start_ranks(ctx: Any, queue: Any, fn: Callable[..., Any], *, world_size: int, args: tuple[Any, ...],
                 timeout_s: float, backend: str, env: dict[str, str] | None, log: str | None) -> list[Any]:
    """Start one process per rank on a free port, with its environment (quiet with ``log``:
    See [Note: quiet ranks]); returns them by rank."""
    port = free_port()
    quiet = {k: v for k, v in QUIET_ENV.items() if k not in os.environ} if log else {}  # the user's own settings win
    rank_env = {**quiet, **(env or {}), _STARTED_BY_SPAWN: "1"}
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, timeout_s, fn, args, queue, rank_env, log),
            daemon=True,
        )
        for r in range(world_size)
    ]
    if log:
        os.makedirs(log, exist_ok=True)
    with _environ({k: v for k, v in rank_env.items() if k == "TORCH_CPP_LOG_LEVEL"}):  # read as torch loads
        for p in procs:
            p.start()
    return procs


def _stop_ranks(procs: list[Any], *, failed: bool) -> None:
    """Join every rank (briefly after a failure), then kill the ones still alive."""
    for p in procs:
        p.join(timeout=5.0 if not failed else 0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def max_over_ranks(*xs: float) -> list[float]:
    """Each of ``xs``, the largest over the ranks (a collective: call on every rank); as
    given when no process group is running."""
    t = torch.tensor(xs, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def broadcast_json(obj: Any, parse: Callable[..., Any]) -> Any:
    """Rank 0's JSON-able object on every rank (sent as JSON text, never pickled user data)."""
    box = [json.dumps(obj) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return parse(json.loads(box[0]))  # type: ignore[arg-type]


@functools.cache
def profiler_log_path() -> str:
    """This process's profiler log: ``profiler.log`` in a directory made for it by ``tempfile.mkdtemp``
    (mode 0700, a fresh name), so no other user can plant a file or symlink there. Made on first use."""
    return os.path.join(tempfile.mkdtemp(prefix="wrapopt-profiler-"), "profiler.log")


@contextlib.contextmanager
def profiler_lines_to_log() -> Iterator[None]:
    """fd 2 to ``profiler_log_path()`` for the duration, outside spawned ranks: See [Note: profiler lines]."""
    fd = None
    if not is_spawned_rank():
        try:
            fd = os.open(profiler_log_path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        except OSError:
            fd = None  # nowhere to put them: leave them on the terminal
    if fd is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
