"""Start and stop process groups without hangs.

``spawn(fn, world_size=2)`` runs ``fn(rank, world_size, *args)`` on that many
local processes with the gloo (CPU) or NCCL (GPU) backend, a free port, one
thread per rank on CPU, a timeout on every collective, and the barrier +
``destroy_process_group()`` ending every rank needs. It returns each rank's
return value, or raises ``DistributedError`` naming the rank that failed,
died or overran the timeout; the other ranks are killed, never left hanging.

``init_from_env()`` does the same set-up inside a job started by ``torchrun``.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wrapopt.errors import DistributedError

__all__ = ["spawn", "init_from_env", "shutdown", "free_port", "default_backend", "device_type"]

DEFAULT_TIMEOUT_S = 120.0


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
    return dist.get_rank(), dist.get_world_size()


def shutdown() -> None:
    """Barrier, then destroy the group (without the barrier ranks abort at exit now and then)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


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
) -> None:
    os.environ.update(env)
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
         "LOCAL_RANK": str(rank % int(env.get("LOCAL_WORLD_SIZE", world_size))), }
    )
    try:
        if backend == "gloo":
            torch.set_num_threads(1)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        result = fn(rank, world_size, *args)
        shutdown()
        queue.put((rank, "ok", result))
    except BaseException as e:  # report, then let the parent kill the rest
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        raise SystemExit(1)


def spawn(
    fn: Callable[..., Any],
    *,
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return results by rank.

    ``fn`` must be importable (module-level). Results travel through a
    multiprocessing queue, so keep them small (numbers, dicts, lists).

    Example:
        >>> def hello(rank, world): return rank
        >>> spawn(hello, world_size=2)  # doctest: +SKIP
        [0, 1]
    """
    backend = backend or default_backend()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, timeout_s, fn, args, queue, dict(env or {})),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s + 30.0  # start-up slack on top of the collective timeout
    failure: str | None = None
    try:
        while len(results) < world_size and failure is None:
            try:
                rank, status, payload = queue.get(timeout=0.2)
            except Exception:  # queue.Empty
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    time.sleep(0.5)  # let its error message arrive first
                    while not queue.empty():
                        rank, status, payload = queue.get()
                        if status == "error":
                            failure = f"rank {rank} failed: {payload}"
                            break
                        results[rank] = payload
                    failure = failure or f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                elif time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in results]
                    failure = f"ranks {missing} did not finish within {timeout_s:.0f} s (timeout); they were killed"
                continue
            if status == "error":
                failure = f"rank {rank} failed: {payload}"
                # A peer that died silently is the cause; the reporting rank saw its socket close.
                time.sleep(0.5)
                silent = [r for r, p in enumerate(procs) if r != rank and p.exitcode not in (None, 0)]
                reported = set()
                while not queue.empty():
                    r2, s2, _ = queue.get()
                    reported.add(r2)
                silent = [r for r in silent if r not in reported]
                if silent:
                    failure = (
                        f"rank {silent[0]} died with exit code {procs[silent[0]].exitcode}; "
                        f"rank {rank} then failed: {payload.splitlines()[0]}"
                    )
            else:
                results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5.0 if failure is None else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    if failure is not None:
        raise DistributedError(failure.rstrip())
    return [results[r] for r in range(world_size)]
