"""Memory traffic of the ops that have no FLOP formula, for the tracer.

[Note: memory-bound ops] Ops without a FLOP formula (norms, activations,
softmax, residual adds, embedding lookups, casts, copies) are bound by memory
bandwidth on a GPU, not by FLOPs: each eager kernel reads its inputs and
writes its outputs once. The tracer sums those bytes per module
(``ModuleInfo.fwd_bytes``); views and other aliasing ops move nothing,
allocations touch nothing, and an indexed read (``embedding``) moves the rows
it reads, not the whole table. Backward bytes are counted in total and
attributed to modules in proportion to their forward bytes, as backward FLOPs
are ([Note: self figures] in ``trace/meta.py``). The cost model turns bytes into
time with the compute profile's ``op_bandwidth_bytes_per_s``; 0 (measured
profiles, whose per-module times already include these ops) keeps them free.
Ops with a FLOP formula (matmuls, fused attention) are taken as compute-bound.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["op_bytes"]

# Ops that read only the rows they index: their traffic is the output (read and written), not the table.
_INDEXED_READS = {torch.ops.aten.embedding, torch.ops.aten.index_select, torch.ops.aten.gather}
# Allocations: no kernel touches the memory.
_ALLOCATIONS = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.new_empty,
                torch.ops.aten.empty_strided, torch.ops.aten.new_empty_strided}


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _storage(t: torch.Tensor) -> Any:
    try:  # the storage's identity; inputs and outputs of one op are all alive, so none is reused
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # tensor subclasses without storage
        return id(t)


def op_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes one memory-bound op moves (an aten op, as a dispatch mode sees it).
    See [Note: memory-bound ops]."""
    if func._overloadpacket in _ALLOCATIONS:
        return 0
    outs = _tensors(out)
    ins = _tensors((args, kwargs))
    if not func._schema.is_mutable:
        in_keys = {_storage(t) for t in ins}
        if any(_storage(t) in in_keys for t in outs):  # a view or alias: nothing moves
            return 0
    out_bytes = sum(t.numel() * t.element_size() for t in outs)
    if func._overloadpacket in _INDEXED_READS:
        return 2 * out_bytes
    return sum(t.numel() * t.element_size() for t in ins) + out_bytes
