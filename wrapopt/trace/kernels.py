"""Per-kernel shapes for the kernel roofline: the tracer's table of matmuls and attention per module.

See [Note: kernel roofline] in ``cost/roofline.py`` for how they are priced. The
table is device-independent: per forward matmul its FLOPs, the elements of its
operands and result (A, B, C), their element size as traced, and its output
tiles of ``TILE`` x ``TILE`` (for wave quantization; 0 where the shape is not a
plain 2-D or batched product); per attention kernel the FLOPs PyTorch's
formula counts and the FLOPs the kernel runs (half of them when causal).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from wrapopt.spec.graph import TILE

__all__ = ["TILE", "MatmulKey", "matmul_key", "attention_run_flops", "ATTENTION_OPS", "MATMUL_OPS"]

_aten = torch.ops.aten
MATMUL_OPS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._grouped_mm, _aten._scaled_mm}
_ATTENTION_NAMES = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention", "flex_attention")
MatmulKey = tuple[float, int, int, int]  # (FLOPs, elements of A, B and C, bytes per element, output tiles)


def is_attention(packet: Any) -> bool:
    name = str(packet)
    return any(n in name for n in _ATTENTION_NAMES)


ATTENTION_OPS = is_attention


def _tiles(m: int, n: int, batch: int = 1) -> int:
    return batch * math.ceil(m / TILE) * math.ceil(n / TILE)


def matmul_key(packet: Any, args: tuple[Any, ...], out: Any, flops: float) -> MatmulKey:
    """One forward matmul's entry in the module's table."""
    mats = [a for a in args if isinstance(a, torch.Tensor)]
    if packet in (_aten.addmm, _aten.baddbmm):
        mats = mats[1:]  # the bias is read once into C: counted with the output
    outs = out if isinstance(out, (list, tuple)) else (out,)
    outs = [t for t in outs if isinstance(t, torch.Tensor)]
    elements = sum(t.numel() for t in mats) + sum(t.numel() for t in outs)
    size = mats[0].element_size() if mats else 2
    tiles = 0
    if packet in (_aten.mm, _aten.addmm) and outs and outs[0].dim() == 2:
        tiles = _tiles(outs[0].shape[0], outs[0].shape[1])
    elif packet in (_aten.bmm, _aten.baddbmm) and outs and outs[0].dim() == 3:
        tiles = _tiles(outs[0].shape[1], outs[0].shape[2], outs[0].shape[0])
    return (float(flops), int(elements), int(size), int(tiles))


def attention_run_flops(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], flops: float) -> float:
    """The FLOPs an attention kernel runs: a causal kernel skips the masked half of the score matrix."""
    causal = kwargs.get("is_causal")
    if causal is None:
        bools = [a for a in args[3:6] if isinstance(a, bool)]  # (q, k, v, dropout_p, is_causal, ...)
        causal = bools[0] if bools else False
    return flops / 2 if causal else flops
