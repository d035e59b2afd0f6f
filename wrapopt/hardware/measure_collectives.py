"""Measure collective latency per message size on each mesh axis.

``measure_fabric()`` runs on every rank of a live process group and returns the
same measured ``FabricProfile`` on each. The ``wrapopt profile-fabric`` command
that spawns ranks and writes the file lives in ``wrapopt.cli.profile_fabric``; the
printed report in ``wrapopt.report.fabric``.

[Note: fabric timing protocol] Per size: a barrier on the world group, warm-up
calls, then ``repeats`` timed repeats back to back (a collective synchronises
its group, so back-to-back calls stay aligned). Small messages get more timed
calls than ``repeats`` (``_samples_for``), so that their figure survives
scheduler ticks. Each repeat's figure is the *max over ranks* of that repeat
(the slowest rank is what a training step waits for); the curve keeps the
*mean over repeats* (See [Note: mean collective times]) and the spread
``(p90 - p10) / median``. One ``all_reduce(MAX)`` at the end carries every
rank's table, so measuring adds no collectives between sizes.

[Note: mean collective times] The simulator adds a step's collectives up, so
the figure it needs per message size is a collective's expected time: the mean
over repeats, not the median. Where ranks stall now and then (ranks sharing
cores: a small all-gather takes several times its median about one time in
five, with both ranks entering it together) the two differ, and the median
leaves those stalls out of every step. NCCL's times on a GPU have little tail,
so there the two agree. The spread stays relative to the median. The per-unit
overhead (``measure_fsdp.measure_unit_overhead``) is a median of paired
differences and takes out the medians of its tiny collectives (with their
means, the plans it priced moved against their prediction from run to run).
The runs behind this note are in docs/history.md, "## hardware".

[Note: concurrent axis groups] The "intra" axis runs one group per node,
the "inter" axis one group per local rank index, and a "sub{d}" axis (when
asked: tensor-parallel groups, a pipeline stage's ranks) one group per d
consecutive ranks, all groups of an axis at the
same time, as HSDP's shard and replicate groups do in training: concurrent
inter-node groups share the nodes' NICs, and that contention belongs in the
measurement.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from wrapopt import launch
from wrapopt.choices import FABRIC_TIMEOUT_S
from wrapopt.errors import ProfileError
from wrapopt.fileio import fmt_bytes
from wrapopt.hardware.collective_ops import all_gather_single, barrier, reduce_scatter_single
from wrapopt.hardware.measure_overlap import measure_overlap_factors
from wrapopt.hardware.profiles import COLLECTIVES, AxisProfile, CollectiveCurve, FabricProfile
from wrapopt.progress import Progress

__all__ = ["default_sizes", "measure_fabric", "barrier", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = FABRIC_TIMEOUT_S
_MAX_SAMPLES_PER_REPEAT = 8  # small messages: see _samples_for


def default_sizes(device_type: str | None = None) -> tuple[int, ...]:
    """Powers of 4 from 4 KiB to 16 MiB on CPU (gloo), to 256 MiB on CUDA (NCCL).

    Gloo past 16 MiB costs seconds per size and adds nothing the bandwidth
    term does not already say; NCCL needs the large sizes to reach its bus
    bandwidth.
    """
    top = 256 * 2**20 if (device_type or launch.device_type()) == "cuda" else 16 * 2**20
    sizes, n = [], 4 * 2**10
    while n <= top:
        sizes.append(n)
        n *= 4
    return tuple(sizes)


@dataclass(frozen=True)
class _Axis:
    name: str
    group: Any  # this rank's ProcessGroup on the axis
    group_size: int
    ranks_per_node_in_group: int


def _build_axes(world: int, rank: int, ranks_per_node: int, group_sizes: tuple[int, ...] = ()) -> list[_Axis]:
    """The axes to measure; every rank creates every group, in the same order (new_group's rule).
    ``group_sizes``: groups of that many consecutive ranks inside a node (an axis "sub{d}" per
    size the intra and world axes do not already measure)."""
    num_nodes = world // ranks_per_node
    axes: list[_Axis] = []
    for d in sorted(set(group_sizes)):
        if d < 2 or d >= min(ranks_per_node, world) or ranks_per_node % d:
            continue  # a group of one measures nothing; a whole node is the intra (or world) axis
        mine = None
        for start in range(0, world, d):
            g = dist.new_group(list(range(start, start + d)))
            if start <= rank < start + d:
                mine = g
        axes.append(_Axis(f"sub{d}", mine, d, d))
    if num_nodes > 1:
        mine = None
        for node in range(num_nodes):
            g = dist.new_group(list(range(node * ranks_per_node, (node + 1) * ranks_per_node)))
            if rank // ranks_per_node == node:
                mine = g
        if ranks_per_node > 1:  # one rank per node: an intra group of one measures nothing
            axes.append(_Axis("intra", mine, ranks_per_node, ranks_per_node))
        mine = None
        for local in range(ranks_per_node):
            g = dist.new_group(list(range(local, world, ranks_per_node)))
            if rank % ranks_per_node == local:
                mine = g
        axes.append(_Axis("inter", mine, num_nodes, 1))
    axes.append(_Axis("world", dist.group.WORLD, world, min(world, ranks_per_node)))
    return axes


def _collective_fn(name: str, nbytes: int, p: int, group: Any, dtype: torch.dtype,
                   device: torch.device) -> tuple[Callable[[], Any], int]:
    """A closure running one collective of (about) ``nbytes`` unsharded bytes, and the exact bytes."""
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(p, nbytes // elem // p * p)  # the unsharded tensor splits evenly over the group
    # Zeros: repeated sums stay 0, never overflowing into inf/NaN slow paths.
    full = torch.zeros(numel, dtype=dtype, device=device)
    shard = torch.zeros(numel // p, dtype=dtype, device=device)
    match name:
        case "all_gather":
            return (lambda: all_gather_single(full, shard, group=group)), numel * elem
        case "reduce_scatter":
            return (lambda: reduce_scatter_single(shard, full, group=group)), numel * elem
        case "all_reduce":
            return (lambda: dist.all_reduce(full, group=group)), numel * elem
        case _:
            raise ValueError(f"unknown collective {name!r}; choose from {COLLECTIVES}")


def _samples_for(fn: Callable[[], Any], sync: Callable[[], None], reduce_dev: torch.device, repeats: int,
                 budget_s: float = 0.1) -> int:
    """Timed calls for one size: ``repeats``, or up to ``_MAX_SAMPLES_PER_REPEAT`` times more
    for messages so small that ``budget_s`` holds them; the same number on every rank.

    A lone 0.1 ms call is at the mercy of one scheduler tick (~4 ms, a few
    percent of calls on a busy host); the median of many such calls shrugs
    those off, the median of 7 does not always.
    """
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=reduce_dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank must make the same number of calls
    return int(min(repeats * _MAX_SAMPLES_PER_REPEAT, max(repeats, budget_s // max(float(t[0]), 1e-9))))


def _stats(times: torch.Tensor) -> tuple[float, float]:
    """Mean (See [Note: mean collective times]) and spread (p90 - p10) / median of one size's repeats."""
    q = torch.quantile(times.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    med = float(q[1])
    return float(times.double().mean()), float((q[2] - q[0]) / med) if med > 0 else 0.0


def measure_fabric(
    *,
    sizes_bytes: tuple[int, ...] | list[int] | None = None,
    collectives: tuple[str, ...] = COLLECTIVES,
    warmup: int = 2,
    repeats: int = 7,
    ranks_per_node: int | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    measure_overlap: bool = True,
    group_sizes: tuple[int, ...] = (),
) -> FabricProfile:
    """Time collectives per message size on each mesh axis; collective: every rank calls it.

    Needs an initialised default process group (gloo on CPU, NCCL on GPU).
    Sizes are unsharded bytes (all-gather output, reduce-scatter input,
    all-reduce buffer), rounded down to split evenly over each group. See
    [Note: fabric timing protocol] and [Note: concurrent axis groups].

    Args:
        sizes_bytes: message sizes; default ``default_sizes()``.
        collectives: any of ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``.
        warmup: untimed calls per size.
        repeats: timed calls per size, at least (small messages get more); the median is kept.
        ranks_per_node: ranks sharing a node; default ``LOCAL_WORLD_SIZE`` or the world size.
        dtype: element type of the messages.
        progress: show progress on rank 0's console (``wrapopt.progress``).
        measure_overlap: also measure the compute/communication overlap factors.
        group_sizes: sizes to measure too, each as concurrent groups of that many consecutive ranks
            (axis "sub{d}"): tensor-parallel groups (See [Note: tensor parallel costs] in cost/tp.py)
            and pipeline stages (``search.pipeline.pp_group_sizes``).

    Returns:
        The same ``FabricProfile`` (kind ``"measured"``) on every rank.

    Example:
        >>> launch.init_from_env()  # doctest: +SKIP
        >>> fabric = measure_fabric(sizes_bytes=[2**20, 2**24])  # doctest: +SKIP
    """
    world, rank, rpn = _check_arguments(collectives=collectives, warmup=warmup, repeats=repeats,
                                        ranks_per_node=ranks_per_node)
    device_type, device, sync, reduce_dev = _devices()
    sizes = sorted({int(s) for s in (sizes_bytes or default_sizes(device_type))})
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"message sizes must be positive, got {sizes_bytes}")

    t_start = time.perf_counter()
    axes = _build_axes(world, rank, rpn, tuple(group_sizes))
    bar = Progress(len(axes) * len(collectives) * len(sizes), desc="profile fabric", unit="message size",
                   enabled=progress and rank == 0)
    cells, times = _time_cells(axes, collectives, sizes, dtype=dtype, device=device, sync=sync, reduce_dev=reduce_dev,
                               warmup=warmup, repeats=repeats, bar=bar)

    overlap = (measure_overlap_factors(device=device, sync=sync, reduce_device=reduce_dev) if measure_overlap
               else (0.0, 0.0))
    copies = _collective_copies(device, world)
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())

    built = _axis_profiles(axes, collectives, sizes, cells, times)
    backend = dist.get_backend()
    num_nodes = world // rpn
    meta = _profile_meta(backend=backend, hosts=hosts, num_nodes=num_nodes, device=device, device_type=device_type,
                         dtype=dtype, repeats=repeats, warmup=warmup, measure_overlap=measure_overlap, t_start=t_start)
    profile = FabricProfile(
        kind="measured",
        name=f"{backend}-{world}x" if num_nodes == 1 else f"{backend}-{num_nodes}x{rpn}",
        backend=backend,
        world_size=world,
        ranks_per_node=rpn,
        axes=built,
        overlap_compute_slowdown=overlap[0],
        overlap_comm_slowdown=overlap[1],
        collective_copies=copies,
        meta=meta,
    )
    # Rank 0's profile everywhere: the latencies already agree (all-reduced), the date and timings may not.
    box = [profile.to_json() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return FabricProfile.from_json(box[0], source="rank 0")


def _check_arguments(*, collectives: tuple[str, ...], warmup: int, repeats: int,
                     ranks_per_node: int | None) -> tuple[int, int, int]:
    """The world size, this rank and the ranks per node, once the arguments and the process
    group are checked."""
    if not dist.is_initialized():
        raise ProfileError("measure_fabric needs a process group; call it under torchrun or use profile_fabric_main()")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise ProfileError("measure_fabric needs at least 2 ranks: a group of one has no collective to time")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    bad = [c for c in collectives if c not in COLLECTIVES]
    if bad or not collectives:
        raise ValueError(f"unknown collectives {bad}; choose from {COLLECTIVES}")
    rpn = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if rpn < 1 or rpn > world or world % rpn:
        raise ValueError(f"ranks_per_node={rpn} must divide the world size {world}")
    return world, rank, rpn


def _devices() -> tuple[str, torch.device, Callable[[], None], torch.device]:
    """The device type, the device the messages live on, its sync, and the device the
    times are reduced on (the device under NCCL, else the CPU)."""
    device_type = launch.device_type()
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    reduce_dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
    return device_type, device, sync, reduce_dev


def _time_cells(axes: list[_Axis], collectives: tuple[str, ...], sizes: list[int], *, dtype: torch.dtype,
                device: torch.device, sync: Callable[[], None], reduce_dev: torch.device, warmup: int, repeats: int,
                bar: Progress) -> tuple[list[tuple[str, str, int, int]], torch.Tensor]:
    """Time every (axis, collective, size) cell: the cells, and their times as the max over ranks."""
    # times[k] holds one (axis, collective, size) cell's repeats; see [Note: fabric timing protocol].
    cells: list[tuple[str, str, int, int]] = []  # (axis, collective, bytes, samples)
    times = torch.zeros(len(axes) * len(collectives) * len(sizes), repeats * _MAX_SAMPLES_PER_REPEAT,
                        dtype=torch.float64)
    for axis in axes:
        for coll in collectives:
            for nbytes in sizes:
                fn, actual = _collective_fn(coll, nbytes, axis.group_size, axis.group, dtype, device)
                barrier()  # world: every axis group starts together
                for _ in range(warmup):
                    fn()
                n = _samples_for(fn, sync, reduce_dev, repeats)
                row = times[len(cells)]
                for i in range(n):
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    row[i] = time.perf_counter() - t0
                cells.append((axis.name, coll, actual, n))
                del fn  # free the buffers before the next size
                bar.update(note=f"{axis.name} {coll} {fmt_bytes(actual)}")
    bar.close(note="")  # the last size measured says nothing once all are done
    t_max = times.to(reduce_dev)
    dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
    times = t_max.cpu()
    return cells, times


def _axis_profiles(axes: list[_Axis], collectives: tuple[str, ...], sizes: list[int],
                   cells: list[tuple[str, str, int, int]], times: torch.Tensor) -> tuple[AxisProfile, ...]:
    """One ``AxisProfile`` per axis: per collective, the mean latency and spread per size."""
    built: list[AxisProfile] = []
    k = 0
    for axis in axes:
        curves = []
        for coll in collectives:
            sz, lat, spr = [], [], []
            for _ in sizes:
                _, _, actual, n = cells[k]
                mean, spread = _stats(times[k, :n])
                if not sz or actual > sz[-1]:  # rounding can merge two tiny sizes on a large group
                    sz.append(actual), lat.append(max(mean, 1e-9)), spr.append(spread)
                k += 1
            curves.append((coll, CollectiveCurve(tuple(sz), tuple(lat), tuple(spr))))
        built.append(AxisProfile(axis.name, axis.group_size, axis.ranks_per_node_in_group, tuple(curves)))

    return tuple(built)


def _profile_meta(*, backend: str, hosts: list[str | None], num_nodes: int, device: torch.device, device_type: str,
                  dtype: torch.dtype, repeats: int, warmup: int, measure_overlap: bool,
                  t_start: float) -> dict[str, Any]:
    """Where and how the profile was measured, for the profile's ``meta``."""
    meta: dict[str, Any] = {
        "backend": backend,
        "hosts": hosts,
        "device": torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if device_type == "cuda" else None,
        "dtype": str(dtype).replace("torch.", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "repeats": repeats,  # the minimum; small messages get up to 8x more timed calls
        "warmup": warmup,
        "statistic": "mean over repeats of the max over ranks",
        "overlap_measured": measure_overlap,
        "measure_s": round(time.perf_counter() - t_start, 2),
    }
    if num_nodes > 1 and len(set(hosts)) == 1:
        # Several "nodes" on one host (tests, demos): the inter axis is not a network.
        meta["simulated_nodes"] = True
    return meta


def _collective_copies(device: torch.device, world: int) -> float:
    """What a collective allocates beside its input and output, in copies of its unsharded size.
    gloo's all-gather and reduce-scatter copy their buffer once (1); NCCL works in its own buffers (0).
    Stated per backend rather than profiled here: a profiler started inside a training job can abort
    its ranks at exit. See [Note: collective copies] in cost/step.py."""
    del world
    return 1.0 if device.type == "cpu" and dist.get_backend() == "gloo" else 0.0
