"""How fast this device runs a model's projections split for tensor parallelism.

``measure_split_efficiency`` times, for each projection a ``TPSpec`` splits, the
forward and backward of ``F.linear`` at the traced shape and at the shape one
tensor-parallel rank runs at the same global batch (``d`` times the rows, a
``1/d`` slice of the features: the same FLOPs), and returns per degree the
summed whole time over the summed split time: ``ComputeProfile.split_efficiency``
(See [Note: tensor parallel costs] in cost/tp.py). Local work only: no collective.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from wrapopt.spec import ModelGraph
from wrapopt.tp import TPSpec, tp_blocks

__all__ = ["measure_split_efficiency"]


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


def measure_split_efficiency(graph: ModelGraph, spec: TPSpec, degrees: Sequence[int], *, device: str | torch.device = "cpu",
                             dtype: torch.dtype = torch.float32, repeats: int = 5) -> tuple[tuple[int, float], ...]:
    """(degree, whole time / split time) for each degree above 1 that divides every split feature."""
    device = torch.device(device)
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
                t_whole.append(_time(rows, fin, fout, device, dtype, repeats))
                t_split.append(_time(rows * d, sin, sout, device, dtype, repeats))
            whole += n * statistics.median(t_whole)
            split += n * statistics.median(t_split)
        if ok and split > 0:
            out.append((d, whole / split))
    return tuple(out)
