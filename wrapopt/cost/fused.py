"""The throughput knobs as the simulator prices them: torchao float8 training and per-block
torch.compile (``SimOptions.float8``, ``.compile``, ``.float8_all_gather``; issue 52).

``with_knobs`` rewrites the graph's figures and the compute profile before any layout is
built (as ``in_compute_dtype`` does for the mixed-precision dtype); the kernel roofline
(``cost/roofline.py``) then prices the float8 linears' GEMMs at the FP8 rate.

[Note: float8 costs] torchao's ``convert_to_float8_training`` swaps the eligible ``nn.Linear``
modules (before tensor parallelism: a view keeps its parent's choice), chosen by TorchTitan's
filter (``float8_linears``): both weight dimensions divisible
by 16, not the output head (TorchTitan's ``filter_fqns=["output"]``: here the last linear
called outside the repeated blocks), and not small (torchao's ``_auto_filter_for_recipe``,
which TorchTitan's ``auto_filter_small_kn`` uses: tensorwise skips K <= 4096 with N <= 1024;
rowwise skips N <= 2048, K <= 1024, and N <= 4096 with K <= 2048). For each one:

- its three GEMMs (forward, input and weight gradients) run on the FP8 tensor cores, at the
  GPU's dense FP8 peak x its GEMM fraction x the preset's fitted ``float8_fraction`` (the
  one constant of this knob; A and B are read at 1 byte per element, C written at 2);
- the scaling is memory-bound work on X (input, ``M x K``), W (weight, ``K x N``) and dY
  (output gradient, ``M x N``), at ``a`` bytes per activation element: eagerly each cast is
  an amax pass (read ``a``) and a cast (read ``a``, write 1): ``2a + 1`` for X and W in
  forward, the same again in backward (torchao saves the high-precision X and W and casts
  them again, transposed), and ``3a + 2`` for dY (amax, cast, and the transposed cast).
  Compiled, the amax fuses into the op that produced the tensor and the transposed copy into
  the cast: ``a + 1`` per cast, ``a + 2`` for dY;
- with the float8 all-gather (``enable_fsdp_float8_all_gather`` + ``precompute_float8_dynamic
  _scale_for_fsdp``) W is cast on its shard before the all-gather, which moves 1 byte per
  eligible element (plus one float32 scale per tensor, negligible): the all-gathered bytes per
  element are the model's eligible share at 1 and the rest at the compute dtype, over the whole
  model (not per unit); the forward's W cast leaves the module;
- what float8 keeps for backward does not change: torchao saves the high-precision X and W
  (``matmul_with_hp_or_float8_args``) and casts them again in backward, which TorchTitan's
  Table 1 reads the same way (77.0 GiB compiled, 76.8 GiB compiled with float8).
Float8 is refused where the GPU has no FP8 tensor cores (A100: ``fp8_flops_per_s`` 0); on a
measured profile its GEMM times stay as measured (a note says so).

[Note: compile costs] TorchTitan compiles each block (``fullgraph=True``) after
``fully_shard``. Inductor fuses each chain of memory-bound ops between two GEMMs into one
kernel, so each module's own memory-bound ops (norms, activations, rotary, residual adds, the
casts) cost one read of the module's input and one write of its output per call, times the
preset's fitted ``compile_fraction`` (the one constant of this knob: what the fused kernels
move beyond that), when that is less than they moved eagerly; its backward's memory-bound bytes
shrink by the same ratio. Saved for backward: inductor's partitioner recomputes such chains in
backward rather than keep their intermediates, so a module without GEMMs or attention of its
own keeps at most its inputs and its children's outputs (a norm keeps its input, an MLP's
gating its two GEMM outputs). Under selective-op checkpointing a unit keeps only the saved
ops' outputs its backward reads ([Note: compile keeps what backward reads] in
wrapopt/selective.py: ``selective_unread`` of its kept bytes go). The per-call overhead stays
(the modules still run, fused).
"""

from __future__ import annotations

from dataclasses import replace

from wrapopt.errors import OptionError
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.spec import ModelGraph, SimOptions
from wrapopt.spec.options import float8_too_small

__all__ = ["float8_linears", "with_knobs", "float8_refusal"]


def float8_linears(graph: ModelGraph, recipe: str) -> dict[str, tuple[int, int]]:
    """``{fqn: (N, K)}`` of the linears float8 training converts: See [Note: float8 costs]."""
    shapes = {f: s for f, s, _d in graph.param_shapes}
    blocks = tuple(graph.blocks)
    linears = [m for m in graph.call_order() if m.cls == "Linear" and len(shapes.get(f"{m.fqn}.weight", ())) == 2]
    outside = [m for m in linears if not any(m.fqn == b or m.fqn.startswith(b + ".") for b in blocks)]
    head = outside[-1].fqn if outside else None
    out = {}
    for m in linears:
        n, k = shapes[f"{m.fqn}.weight"]
        if m.fqn != head and n % 16 == 0 and k % 16 == 0 and not float8_too_small(recipe, n, k):
            out[m.fqn] = (n, k)
    return out


def float8_refusal(compute: ComputeProfile, recipe: str) -> str | None:
    """Why float8 cannot be priced on this device (one line), or None."""
    if compute.kind != "analytical" or compute.meta.get("fp8_flops_per_s"):
        return None
    gpu = compute.meta.get("gpu") or compute.device
    return (f"float8 training (--float8 {recipe}) needs FP8 tensor cores, which the GPU {gpu} lacks: the "
            "tensorwise and rowwise recipes run their GEMMs on them (H100, H200); drop --float8, or choose a GPU "
            "with FP8 (--gpu h100-sxm, h200)")


def with_knobs(graph: ModelGraph, compute: ComputeProfile, options: SimOptions,
               act_bytes: float = 2.0) -> tuple[ModelGraph, ComputeProfile, float, tuple[str, ...]]:
    """(graph, compute, float8 all-gather share, notes) under the options' knobs: See [Note:
    float8 costs] and [Note: compile costs]. The share is the eligible elements' share of all
    parameter elements (0 without the float8 all-gather)."""
    if options.float8 == "none" and not options.compile:
        return graph, compute, 0.0, ()
    notes: list[str] = []
    eligible: dict[str, tuple[int, int]] = {}
    if options.float8 != "none":
        why = float8_refusal(compute, options.float8)
        if why:
            raise OptionError(why)
        known = compute.meta.get("float8_modules")  # a view's parent chose on the whole shapes, as torchao does
        if known is None:
            eligible = float8_linears(graph, options.float8)
        else:
            shapes = {f.rsplit(".", 1)[0]: sh for f, sh, _d in graph.param_shapes if f.endswith(".weight")}
            eligible = {f: tuple(shapes[f]) for f in known if len(shapes.get(f, ())) == 2}
        if compute.kind != "analytical":
            notes.append("float8: GEMM times as measured (a measured profile has no FP8 rate); casts priced")
    frac = float(compute.meta.get("compile_fraction", 1.0))
    a, ag = act_bytes, options.float8_all_gather
    children: dict[str, int] = {}
    for m in graph.modules:
        if m.parent is not None:
            children[m.parent] = children.get(m.parent, 0) + m.output_bytes * max(m.num_calls, 1)
    modules = []
    for m in graph.modules:
        fb, bb, saved = float(m.fwd_bytes), float(m.bwd_bytes), m.saved_bytes
        # See [Note: compile keeps what backward reads] in wrapopt/selective.py
        kept = int(m.selective_kept_bytes * (1.0 - m.selective_unread)) if options.compile else m.selective_kept_bytes
        calls = max(m.num_calls, 1)
        if m.fqn in eligible:
            n, k = eligible[m.fqn]
            x, y, w = m.input_bytes / a * calls, m.output_bytes / a * calls, float(n * k) * calls
            cast, dy = (a + 1, a + 2) if options.compile else (2 * a + 1, 3 * a + 2)
            fb += cast * (x + (0.0 if ag else w))
            bb += cast * x + (2.0 if ag else cast) * w + dy * y
        if options.compile and m.num_calls > 0 and m.fqn not in eligible:  # the casts are priced fused above
            fused = frac * (m.input_bytes + m.output_bytes) * calls
            if fused < fb:
                bb, fb = bb * fused / fb if fb else bb, fused
            if not m.matmuls and not m.attention_flops:
                saved = min(saved, (m.input_bytes * calls) + children.get(m.fqn, 0))
        modules.append(replace(m, fwd_bytes=int(fb), bwd_bytes=int(bb), saved_bytes=int(saved),
                               selective_kept_bytes=kept))
    tree = graph.tree.copy()
    for m in modules:
        tree.nodes[m.fqn]["info"] = m
    share = 0.0
    if ag and eligible:
        share = sum(n * k for n, k in eligible.values()) / max(1, graph.num_params)
    meta = {**compute.meta, "float8_modules": frozenset(eligible)} if eligible else compute.meta
    return replace(graph, modules=tuple(modules), tree=tree), replace(compute, meta=meta), share, tuple(notes)
