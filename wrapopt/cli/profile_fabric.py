"""The ``wrapopt profile-fabric`` command: its options and its body.

``profile_fabric_main()`` measures in place under ``torchrun`` (rank 0 writes
the file) and otherwise spawns local gloo/NCCL ranks itself (the parent
writes rank 0's profile). Either way the output path is checked before
anything is measured, and the file is written once, atomically, only after a
complete measurement. ``add_parser()`` and ``run()`` plug it into
``wrapopt.cli``, as every command module does.

The spawned worker ``_profile_worker`` stays module-level: ``launch.spawn``
pickles the target by module path. torch and the measurement load inside the
functions that run them, so ``add_parser`` needs none (See [Note: first
contact] in wrapopt/cli/main.py).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Callable

from wrapopt.checks import check_count
from wrapopt.choices import FABRIC_TIMEOUT_S
from wrapopt.cli.logs import rank_log_dir
from wrapopt.cli.options import count_int, local_ranks, positive_float, positive_int, tp_degree
from wrapopt.errors import ProfileError
from wrapopt.fileio import check_writable, fmt_bytes, parse_bytes

if TYPE_CHECKING:
    from wrapopt.hardware.profiles import FabricProfile

__all__ = ["profile_fabric_main", "add_parser", "run"]


def _under_torchrun() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _check_out(out_path: str) -> None:
    try:
        check_writable(out_path)
    except OSError as e:
        raise ProfileError(f"cannot write the fabric profile to {out_path}: {e.strerror or e}; "
                           "choose another --out") from None


def _profile_worker(rank: int, world: int, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    from wrapopt.hardware.measure_collectives import measure_fabric

    profile = measure_fabric(**kwargs)
    return profile.to_json() if rank == 0 else None  # one copy through the result queue is enough


def _measure_spawned(
    out_path: str, *, worker: Callable[..., Any], world_size: int, timeout_s: float, kwargs: dict[str, Any],
    log_dir: str | None = None,
) -> FabricProfile:
    """Spawn local ranks running ``worker``; save rank 0's profile only if every rank finished."""
    from wrapopt import launch
    from wrapopt.hardware.profiles import FabricProfile

    results = launch.spawn(worker, world_size=world_size, args=(kwargs,), timeout_s=timeout_s, log_dir=log_dir)
    profile = FabricProfile.from_json(results[0], source="rank 0")
    profile.save(out_path)
    return profile


def profile_fabric_main(
    out_path: str,
    *,
    world_size: int = 2,
    ranks_per_node: int | None = None,
    sizes_bytes: tuple[int, ...] | list[int] | None = None,
    repeats: int = 7,
    warmup: int = 2,
    measure_overlap: bool = True,
    progress: bool = True,
    timeout_s: float = FABRIC_TIMEOUT_S,
    log_dir: str | None = None,
    group_sizes: tuple[int, ...] = (),
) -> FabricProfile:
    """Measure the fabric and write it to ``out_path`` (the body of ``wrapopt profile-fabric``).

    Under ``torchrun`` (or inside an initialised group) every rank measures
    and rank 0 writes. Otherwise ``world_size`` local ranks are spawned and
    the parent writes rank 0's profile. The output path is checked before
    anything is measured; a rank that fails, dies or overruns ``timeout_s``
    raises ``DistributedError`` naming it, and no file is written.

    Args:
        out_path: where the profile JSON goes.
        world_size: ranks to spawn when not under torchrun (ignored under it).
        ranks_per_node: ranks per node; under spawn, fewer than ``world_size``
            simulates several nodes on this host (labelled ``simulated_nodes``).
        sizes_bytes, repeats, warmup, measure_overlap, progress, group_sizes: as in ``measure_fabric``.
        timeout_s: limit on every collective, and on the whole spawned run (+30 s start-up).
        log_dir: spawned ranks only: their own output goes to log files here, not to the
            terminal (See [Note: quiet ranks] in wrapopt/launch.py).

    Returns:
        The profile written.

    Example:
        >>> profile_fabric_main("fabric.json", world_size=2)  # doctest: +SKIP
    """
    import torch.distributed as dist

    from wrapopt import launch
    from wrapopt.hardware.measure_collectives import barrier, measure_fabric

    kwargs = dict(sizes_bytes=sizes_bytes, repeats=repeats, warmup=warmup, ranks_per_node=ranks_per_node,
                  measure_overlap=measure_overlap, progress=progress, group_sizes=tuple(group_sizes))
    if not _under_torchrun():
        check_count(world_size, "world_size (--world-size: local ranks to spawn)", minimum=2)
        _check_out(out_path)
        return _measure_spawned(out_path, worker=_profile_worker, world_size=world_size, timeout_s=timeout_s,
                                kwargs=kwargs, log_dir=log_dir)

    owns_group = not dist.is_initialized()
    launch.init_from_env(timeout_s=timeout_s)
    try:
        with launch.naming_lost_ranks():  # a lost peer is named, not only gloo's symptom
            # Rank 0 writes, so rank 0 checks; every rank learns the verdict, so none is left waiting.
            verdict: list[str | None] = [None]
            if dist.get_rank() == 0:
                try:
                    _check_out(out_path)
                except ProfileError as e:
                    verdict[0] = str(e)
            dist.broadcast_object_list(verdict, src=0)
            if verdict[0] is not None:
                raise ProfileError(verdict[0])
            profile = measure_fabric(**kwargs)
            if dist.get_rank() == 0:
                profile.save(out_path)
            barrier()  # no rank reports success before the file exists
            return profile
    finally:
        if owns_group:
            launch.shutdown()


def _sizes_arg(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(parse_bytes(s) for s in text.split(",") if s.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--sizes: {e} (example: 4KiB,64KiB,1MiB)") from None
    if not sizes:  # an empty list is not the default sizes
        raise argparse.ArgumentTypeError(f"expected message sizes like 4KiB,64KiB,1MiB, got {text!r}")
    return sizes


def _size_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tp_arg(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tp: expected degrees like 2,4, got {text!r}") from None
    if any(d < 2 for d in sizes):
        raise argparse.ArgumentTypeError(f"--tp: degrees must be at least 2, got {text!r}")
    return sizes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt profile-fabric`` to the CLI's sub-commands; it runs ``run``."""
    parser = subparsers.add_parser("profile-fabric", help="measure collective latency per size on each mesh axis")
    parser.add_argument("--out", required=True, help="fabric profile JSON to write")
    parser.add_argument("--world-size", type=local_ranks, default=2,
                        help="local ranks to spawn when not under torchrun (default 2)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=None,
                        help="ranks per node (default LOCAL_WORLD_SIZE or the world size); fewer simulates nodes "
                             "locally")
    parser.add_argument("--sizes", type=_sizes_arg, default=None, help="message sizes, e.g. 4KiB,64KiB,1MiB")
    parser.add_argument("--max-size", type=_size_arg, default=None, help="drop default sizes above this, e.g. 4MiB")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed calls per size (mean kept; default 7)")
    parser.add_argument("--warmup", type=count_int, default=2, help="untimed calls per size (default 2)")
    parser.add_argument("--timeout", type=positive_float, default=FABRIC_TIMEOUT_S,
                        help="seconds before a stuck rank is reported")
    parser.add_argument("--no-overlap", action="store_true", help="skip the compute/communication overlap measurement")
    parser.add_argument("--quiet", action="store_true", help="no progress line and no summary table")
    parser.add_argument("--tp", type=_tp_arg, default=(), metavar="2,4",
                        help="also measure tensor-parallel groups of these many consecutive ranks "
                             "(for --tp searches)")
    parser.add_argument("--pp", type=tp_degree, default="1", metavar="auto|2|4",
                        help="also measure the groups a pipeline of this degree uses inside a node: each stage's "
                             "consecutive ranks and rank pairs for its sends (for --pp searches)")
    return parser


def group_sizes(args: argparse.Namespace) -> tuple[int, ...]:
    """The sub-groups ``--tp`` and ``--pp`` ask for: See [Note: pipeline fabric] in search/pipeline.py.
    The world and ranks per node are torchrun's where it started this process, else the options'."""
    from wrapopt.search.pipeline import pp_group_sizes
    from wrapopt.spec import MeshSpec, ParallelRequest

    world = int(os.environ.get("WORLD_SIZE", args.world_size)) if _under_torchrun() else args.world_size
    rpn = args.ranks_per_node or (int(os.environ.get("LOCAL_WORLD_SIZE", world)) if _under_torchrun() else world)
    mesh = MeshSpec(world_size=world, ranks_per_node=rpn, shard_size=world)
    return pp_group_sizes(ParallelRequest(mesh=mesh, pp=args.pp), also=args.tp)


def run(args: argparse.Namespace) -> int:
    """Run ``profile-fabric`` from parsed arguments; library errors propagate to ``cli.main``."""
    import torch.distributed as dist

    from wrapopt.hardware.measure_collectives import default_sizes
    from wrapopt.launch import logs_line
    from wrapopt.report.fabric import format_fabric

    sizes = args.sizes or default_sizes()
    if args.max_size is not None:
        sizes = tuple(s for s in sizes if s <= args.max_size)
        if not sizes:
            raise ValueError(f"--max-size {fmt_bytes(args.max_size)} leaves no message size to measure")
    spawned = not _under_torchrun()
    log_dir = rank_log_dir(args, os.path.dirname(os.path.abspath(args.out))) if spawned else None
    profile = profile_fabric_main(
        args.out, world_size=args.world_size, ranks_per_node=args.ranks_per_node, sizes_bytes=sizes,
        repeats=args.repeats, warmup=args.warmup, measure_overlap=not args.no_overlap,
        progress=not args.quiet, timeout_s=args.timeout, log_dir=log_dir, group_sizes=group_sizes(args),
    )
    rank0 = dist.get_rank() == 0 if dist.is_initialized() else int(os.environ.get("RANK", "0")) == 0
    if rank0:
        if not args.quiet:
            print(format_fabric(profile))
        print(f"wrote {args.out}")
        if log_dir and not args.quiet:
            print(logs_line(log_dir))
    return 0
