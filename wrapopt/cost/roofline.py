"""Compute time of one module's own kernels on a stated GPU: the kernel roofline.

[Note: kernel roofline] A GPU preset's compute is priced per kernel from its
shape, not by one efficiency for all FLOPs (``module_time`` in ``calls.py``
uses it when the profile states ``matmul_flops_per_s``; measured profiles keep
FLOPs / their measured rate):

- **Matmul** (mm, addmm, bmm, grouped): ``FLOPs / (R x waves) + bytes / BW``, a
  roofline made smooth by adding its two terms instead of taking the larger.
  ``R`` is the GPU's achievable tensor-core rate (peak in the compute dtype x
  the preset's fitted GEMM fraction), ``BW`` the achieved HBM bandwidth, bytes =
  the elements of A, B and C at the compute dtype (each read or written once;
  the tiles' re-reads hit L2). The sum charges what a kernel does not hide of
  its loads behind its math: nearly nothing for a wide GEMM (d = 4096: the bytes
  term is ~5% of the FLOPs term), a quarter for a 768-wide one, whose few
  k-steps leave the pipeline's fill and drain exposed, which the max (the
  strict roofline) misses. ``waves`` is wave
  quantization: a GEMM of ``t`` output tiles of 128 x 128 on ``s``
  multiprocessors runs ``ceil(t / s)`` waves, busy ``t / (s ceil(t / s))`` of
  the time; it matters for few tiles (a 768-wide layer at a small
  micro-batch) and vanishes for many.
- **Attention** runs as one fused kernel (FlashAttention / SDPA): its FLOPs as it
  runs them (causal: half of the formula's, the masked blocks are skipped) at a
  rate of its own, the peak x the preset's fitted attention fraction.
- **Other FLOPs** (convolutions): at ``R``.
- **Memory-bound ops**: bytes / op bandwidth, as [Note: memory-bound ops].
- **Float8 linears** (torchao; ``meta["float8_modules"]``): their GEMMs as above at the FP8 rate
  (``meta["fp8_flops_per_s"]``: the FP8 peak x the GEMM fraction x the fitted ``float8_fraction``),
  A and B read at 1 byte per element, C written at 2 (4/3 a byte per element on average), class
  ``GEMM fp8``. See [Note: float8 costs] in cost/fused.py.

Backward reuses the forward's shapes: a linear layer's two backward GEMMs (input
and weight gradient) move the same three matrices and run as many FLOPs as its
forward, so backward matmul FLOPs are priced at the forward's effective rate
(its time / FLOPs), attention's backward at the attention rate with the same
causal share and the fused kernel's own FLOPs: torch's formula counts four
matmuls (dS, dV, dQ, dK: twice the forward), but every fused kernel
(FlashAttention 2, torch's flash and memory-efficient SDPA, cuDNN) keeps no
score matrix and recomputes ``S = QK^T`` in its backward, a fifth: 2.5x the
forward (FlashAttention 2's own FLOP count, ``FLASH_BWD_RECOMPUTE``). Counting
four had priced a checkpointed row's attention (forward, recompute, backward:
1 + 1 + 2 at a rate fitted where most rows run 1 + 2) too slow against its
uncheckpointed neighbours: A100 80GB's checkpointed rows at a median of 0.943
of published, 0.954 with the fifth (refit, ``results/published.md``).

The table is the traced forward's; a module whose FLOPs a later stage divides
(tensor parallel) scales its table's times by the same factor.
"""

from __future__ import annotations

import math

from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.spec import ModuleInfo

__all__ = ["kernel_times", "KERNEL_CLASSES"]

KERNEL_CLASSES = ("GEMM", "GEMM fp8", "attention", "memory-bound")
FLASH_BWD_RECOMPUTE = 1.25  # the fused kernel's backward FLOPs / torch's formula's: 5 matmuls to 4 (the note)


def _matmul_s(m: ModuleInfo, compute: ComputeProfile, elem_bytes: float | None,
              rate: float | None = None) -> tuple[float, float]:
    """(seconds, FLOPs) of the module's forward matmul table (``rate``: the FP8 one of a float8 linear)."""
    rate, bw, sms = rate or compute.matmul_flops_per_s, compute.memory_bandwidth_bytes_per_s, compute.num_sms
    t = flops = 0.0
    for f, elements, size, tiles, calls in m.matmuls:
        busy = tiles / (sms * math.ceil(tiles / sms)) if tiles and sms else 1.0
        t += calls * (f / (rate * busy) + elements * (elem_bytes or size) / bw)  # the smoother: a sum
        flops += calls * f
    return t, flops


def kernel_times(m: ModuleInfo, compute: ComputeProfile) -> dict[str, tuple[float, float]]:
    """(forward, backward) seconds of one module's own ops per kernel class, one call of the traced
    batch summed over calls, without per-call overhead. See [Note: kernel roofline]."""
    op_bw = compute.op_bandwidth_bytes_per_s
    mem = (m.fwd_bytes / op_bw, m.bwd_bytes / op_bw) if op_bw else (0.0, 0.0)
    if not compute.matmul_flops_per_s:
        return {"GEMM": (m.fwd_flops / compute.flops_per_s, m.bwd_flops / compute.flops_per_s),
                "attention": (0.0, 0.0), "memory-bound": mem}
    dtype = compute.meta.get("dtype")
    elem = {"bfloat16": 2, "float16": 2, "float32": 4}.get(dtype) if isinstance(dtype, str) else None
    fp8 = m.fqn in compute.meta.get("float8_modules", ())
    f8_rate = compute.meta.get("fp8_flops_per_s") if fp8 else None
    mm_s, mm_flops = _matmul_s(m, compute, 4 / 3 if f8_rate else elem, f8_rate)
    rest = max(m.fwd_flops - m.attention_flops, 0.0)  # the matmuls', and any other FLOP op's
    if mm_flops > 0:
        mm_s *= rest / mm_flops  # a divided module (tensor parallel) runs a share of its table
        rest_rate = mm_s / rest if rest else 0.0
    else:
        mm_s, rest_rate = rest / compute.matmul_flops_per_s, 1 / compute.matmul_flops_per_s
    att_rate = compute.attention_flops_per_s or compute.matmul_flops_per_s
    run = m.attention_run_flops / m.attention_flops if m.attention_flops else 1.0
    att_s = m.attention_flops * run / att_rate
    bwd_att = m.bwd_flops * m.attention_flops / m.fwd_flops if m.fwd_flops else 0.0
    bwd_rest = m.bwd_flops - bwd_att
    gemm = (mm_s, bwd_rest * rest_rate if rest else bwd_rest / compute.matmul_flops_per_s)
    return {"GEMM": (0.0, 0.0) if f8_rate else gemm, "GEMM fp8": gemm if f8_rate else (0.0, 0.0),
            "attention": (att_s, bwd_att * FLASH_BWD_RECOMPUTE * run / att_rate), "memory-bound": mem}
