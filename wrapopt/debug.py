"""Debugging helpers for a sharded model: one parameter in full, and memory across ranks.

Both are collective: every rank of the process group calls them, in the same
order. Names are checked on every rank before any collective runs, so a typo
fails everywhere instead of leaving some ranks waiting.

Example:
    >>> from wrapopt.debug import full_tensor, memory_report
    >>> w = full_tensor(model, "layers.0.attn.q_proj.weight")  # doctest: +SKIP
    >>> print(memory_report(model, optimizer))  # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import os
import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.errors import WrapoptError
from wrapopt.fileio import fmt_bytes
from wrapopt.fingerprint import strip_wrapper_prefixes

__all__ = ["full_tensor", "memory_report", "MemoryReport"]


def full_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The whole of parameter ``name``, gathered from its shards; collective.

    Works for FSDP2 (``fully_shard``: the parameter is a DTensor), for FSDP1
    (``FullyShardedDataParallel``: names as in the unwrapped model) and for
    an unsharded model (a copy). Returns a detached tensor on every rank.

    Raises:
        WrapoptError: no parameter of that name; the message lists the closest names.
    """
    from torch.distributed.tensor import DTensor

    if _fsdp1_root(model) is not None:
        return _fsdp1_full(model, name)
    p = _lookup(model, name)  # local check, the same on every rank: nobody is left in a collective
    if isinstance(p, DTensor):
        return p.full_tensor().detach().clone()
    return p.detach().clone()


def _lookup(model: nn.Module, name: str) -> torch.Tensor:
    params = {strip_wrapper_prefixes(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    if name not in params:
        close = difflib.get_close_matches(name, list(params), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; the model has {len(params)} parameters"
        raise WrapoptError(f"full_tensor: the model has no parameter {name!r}{hint}")
    return params[name]


def _fsdp1_root(model: nn.Module) -> nn.Module | None:
    return next((m for m in model.modules() if type(m).__name__ == "FullyShardedDataParallel"), None)


def _fsdp1_full(model: nn.Module, name: str) -> torch.Tensor:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # Every rank gathers every unit here (FSDP1 has no per-parameter gather); an unknown name
    # then fails on every rank alike, after the same collectives.
    with FSDP.summon_full_params(model, writeback=False, recurse=True):
        return _lookup(model, name).detach().clone()


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Memory figures of every rank, summarised per category.

    ``per_rank[category]`` lists each rank's bytes (rank order); ``rows``
    holds min, median, max and the total across ranks per category. ``str()``
    is the table.
    """

    device: str  # "cpu" or "cuda"
    world_size: int
    categories: tuple[str, ...]
    per_rank: dict[str, tuple[float, ...]]
    rows: dict[str, dict[str, float]]  # category -> {"min", "median", "max", "total"}

    def __str__(self) -> str:
        return self.table()

    def table(self) -> str:
        title = f"memory ({self.device}, {self.world_size} ranks)"
        head = f"{title:34} {'min':>11} {'median':>11} {'max':>11} {'total':>11}"
        lines = [head, "-" * len(head)]
        for c in self.categories:
            r = self.rows[c]
            lines.append(f"{c:34} " + " ".join(f"{fmt_bytes(r[k]):>11}" for k in ("min", "median", "max", "total")))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "world_size": self.world_size,
                "per_rank": {c: list(v) for c, v in self.per_rank.items()}, "rows": self.rows}


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                  device: str | None = None) -> MemoryReport:
    """Gather each rank's memory figures into one table; collective, result on every rank.

    CPU figures: bytes of this rank's parameters (the local shards), their
    gradients, the optimizer state (when ``optimizer`` is given), and the
    process's resident set size now and at its peak. CUDA figures (when the
    model's parameters are on a GPU): ``memory_allocated``,
    ``memory_reserved`` and ``max_memory_allocated``, besides the tensor
    figures. Without a process group it reports this process alone.

    Args:
        model: sharded (FSDP2 or FSDP1) or not.
        optimizer: its state is counted when given.
        device: "cpu" or "cuda"; default: where the model's parameters are.
    """
    local = _local_figures(model, optimizer, device)
    categories = tuple(local)
    values = torch.tensor([float(local[c]) for c in categories], dtype=torch.float64)
    if dist.is_initialized():
        # NCCL moves CUDA tensors only; gloo CPU tensors. The categories are the same on every rank
        # (the same code on the same kind of device), so one all_gather of numbers suffices.
        comm_dev = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                    else torch.device("cpu"))
        values = values.to(comm_dev)
        gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, values)
        table = torch.stack(gathered).cpu()
    else:
        table = values.unsqueeze(0)
    per_rank = {c: tuple(float(x) for x in table[:, i]) for i, c in enumerate(categories)}
    rows = {c: {"min": min(v), "median": statistics.median(v), "max": max(v), "total": sum(v)}
            for c, v in per_rank.items()}
    dev = device or _model_device(model)
    return MemoryReport(device=dev, world_size=table.shape[0], categories=categories, per_rank=per_rank, rows=rows)


def _model_device(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return "cuda" if p is not None and _local(p).device.type == "cuda" else "cpu"


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _tensor_bytes(tensors: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        loc = _local(t)
        if loc.is_meta:
            continue
        key = loc.untyped_storage().data_ptr() if loc.numel() else id(loc)
        if key in seen:  # tied parameters, views of one buffer
            continue
        seen.add(key)
        total += loc.numel() * loc.element_size()
    return total


def _local_figures(model: nn.Module, optimizer: torch.optim.Optimizer | None, device: str | None) -> dict[str, float]:
    params = list(model.parameters())
    figures: dict[str, float] = {
        "parameters (local shards)": _tensor_bytes(params),
        "gradients (local shards)": _tensor_bytes(p.grad for p in params),
    }
    if optimizer is not None:
        states = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        figures["optimizer state (local)"] = _tensor_bytes(states)
    dev = device or _model_device(model)
    if dev == "cuda":
        figures["cuda allocated"] = torch.cuda.memory_allocated()
        figures["cuda reserved"] = torch.cuda.memory_reserved()
        figures["cuda max allocated"] = torch.cuda.max_memory_allocated()
    rss, peak = _rss_bytes()
    figures["process RSS"] = rss
    figures["process peak RSS"] = max(peak, rss)  # the two come from different counters
    return figures


def _rss_bytes() -> tuple[int, int]:
    """Resident set size now and at its peak (Linux: /proc; elsewhere the peak from getrusage)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if os.uname().sysname == "Darwin" else 1024  # bytes on macOS, KiB on Linux
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = peak
    return rss, peak
