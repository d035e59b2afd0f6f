"""How fast this device runs a model's projections split for tensor parallelism.

``measure_split_efficiency`` times, for each projection a ``TPSpec`` splits, the
forward and backward of ``F.linear`` at the traced shape and at the shape one
tensor-parallel rank runs at the same global batch (``d`` times the rows, a
``1/d`` slice of the features: the same FLOPs), and returns per degree the
summed whole time over the summed split time: ``ComputeProfile.split_efficiency``
(See [Note: tensor parallel costs] in cost/tp.py). Local work only: no collective.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from wrapopt.errors import PlanError
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.spec import ModelGraph
from wrapopt.tp import TPSpec, builtin_tp_plan, tp_blocks

__all__ = ["measure_split_efficiency", "measure_tp_overhead", "with_tp_measurements"]


def _shapes(graph: ModelGraph, spec: TPSpec, elem: int) -> dict[tuple[int, int, int, str], int]:
    """(rows, in, out, style) -> how many projections of that shape one step runs."""
    weights = {fqn: shape for fqn, shape, _dt in graph.param_shapes}
    out: dict[tuple[int, int, int, str], int] = {}
    for b in tp_blocks(graph, spec):
        for rel, style in spec.styles(graph.info(b).cls).items():
            w = weights.get(f"{b}.{rel}.weight")
            m = graph.info(f"{b}.{rel}")
            if w is None or len(w) != 2 or m.num_calls < 1:
                continue
            fout, fin = int(w[0]), int(w[1])
            rows = max(1, m.input_bytes // (fin * elem))
            key = (rows, fin, fout, style)
            out[key] = out.get(key, 0) + m.num_calls
    return out


def _time(rows: int, fin: int, fout: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    x = torch.randn(rows, fin, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(fout, fin, device=device, dtype=dtype, requires_grad=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once() -> float:
        sync()
        t0 = time.perf_counter()
        y = F.linear(x, w)
        y.backward(torch.ones_like(y))
        sync()
        return time.perf_counter() - t0

    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def measure_split_efficiency(graph: ModelGraph, spec: TPSpec, degrees: Sequence[int], *,
                             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                             repeats: int = 5,
                             timer: Callable[[int, int, int], float] | None = None) -> tuple[tuple[int, float], ...]:
    """(degree, whole time / split time) for each degree above 1 that divides every split feature.

    ``timer(rows, in_features, out_features)`` gives the seconds of one projection's forward and
    backward at that shape; default: the median of ``repeats`` timed ``F.linear`` calls on
    ``device`` in ``dtype`` (tests pass a synthetic one)."""
    device = torch.device(device)
    timer = timer or (lambda rows, fin, fout: _time(rows, fin, fout, device, dtype, repeats))
    # rows from the traced input bytes, in the traced dtype
    shapes = _shapes(graph, spec, max(1, round(graph.param_bytes / max(1, graph.num_params))))
    out = []
    for d in sorted({int(d) for d in degrees if int(d) > 1}):
        whole = split = 0.0
        ok = True
        for (rows, fin, fout, style), n in shapes.items():
            if (fout if style == "colwise" else fin) % d:
                ok = False
                break
            sin, sout = (fin, fout // d) if style == "colwise" else (fin // d, fout)
            # interleaved, so that drift of the machine falls on both
            t_whole, t_split = [], []
            for _ in range(3):
                t_whole.append(timer(rows, fin, fout))
                t_split.append(timer(rows * d, sin, sout))
            whole += n * statistics.median(t_whole)
            split += n * statistics.median(t_split)
        if ok and split > 0:
            out.append((d, whole / split))
    return tuple(out)


class _Pair(torch.nn.Module):
    """A column-wise then a row-wise projection, as in an MLP."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(width, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def measure_tp_overhead(size: int, *, rows: int = 256, width: int = 64, hidden: int = 256, repeats: int = 5,
                        device: str | torch.device | None = None) -> tuple[float, float]:
    """(forward, backward) seconds a tensor-parallel projection costs per call beyond its split
    matmul and its all-reduce: DTensor's dispatch, input and output hooks. Collective: every rank
    calls it under a process group whose size ``size`` divides; groups of ``size`` consecutive ranks.

    Times a ``ColwiseParallel`` / ``RowwiseParallel`` pair (forward: one all-reduce, backward: one),
    the same pair as plain local ``nn.Linear``s of the split shapes, and a bare all-reduce of the
    activation, interleaved; per projection: (pair - local - all-reduce) / 2, medians, at least 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    if size < 2 or world % size:
        raise ValueError(f"tensor-parallel degree {size} must be at least 2 and divide the world of {world}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mesh = init_device_mesh(dev.type, (world // size, size), mesh_dim_names=("dp", "tp"))["tp"]
    group = mesh.get_group()
    torch.manual_seed(0)
    tp = parallelize_module(_Pair(width, hidden).to(dev), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    local = _Pair(width, hidden // size).to(dev)
    x = torch.randn(rows, width, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def fwd_bwd(m: torch.nn.Module) -> tuple[float, float]:
        inp = x.detach().requires_grad_(True)
        sync()
        t0 = time.perf_counter()
        y = m(inp)
        sync()
        t1 = time.perf_counter()
        y.sum().backward()
        sync()
        return t1 - t0, time.perf_counter() - t1

    def all_reduce() -> tuple[float, float]:
        buf = torch.randn(rows, width, device=dev)
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        sync()
        return time.perf_counter() - t0, 0.0

    runs = (lambda: fwd_bwd(tp), lambda: fwd_bwd(local), all_reduce)
    times: list[list[tuple[float, float]]] = [[], [], []]
    for r in range(2 + max(3 * repeats, 9)):
        for i, fn in enumerate(runs):
            dist.barrier(group=group)
            t = fn()
            if r >= 2:
                times[i].append(t)
    med = [(statistics.median(a for a, _ in ts), statistics.median(b for _, b in ts)) for ts in times]
    (tf, tb), (lf, lb), (ar, _) = med
    out = torch.tensor([max(0.0, (tf - lf - ar) / 2), max(0.0, (tb - lb - ar) / 2)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # the slowest rank is what a step waits for
    return float(out[0]), float(out[1])


def with_tp_measurements(compute: ComputeProfile, graph: ModelGraph, sizes: Sequence[int]) -> ComputeProfile:
    """``compute`` with the split efficiency of ``graph``'s recognised projections at ``sizes``
    and the tensor-parallel overhead at the largest size that divides the world (collective:
    every rank calls it). Unchanged when no size applies or the model cannot be split."""
    sizes = [d for d in sizes if d > 1 and dist.get_world_size() % d == 0]
    if not sizes:
        return compute
    try:
        spec = builtin_tp_plan(graph)
    except PlanError:
        return compute  # every rank decides alike: the graph is the same
    eff = measure_split_efficiency(graph, spec, sizes, device=compute.device)
    return dataclasses.replace(compute, split_efficiency=eff, tp_overhead_s=measure_tp_overhead(max(sizes)))
