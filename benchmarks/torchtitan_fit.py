"""The knob constants of the 500 W H100 preset, fitted on TorchTitan's Table 1: ``python -m benchmarks.torchtitan_fit``.

[Note: the TorchTitan fit] The fit set is Table 1 of pytorch/torchtitan
``benchmarks/llama3_h100_202412_torchtitan.md`` (Llama 3.1 8B, 8 H100 96 GB HBM2e at 500 W, local
batch 2, global batch 16, seq 8192, selective AC), its three rows in order, one constant each, by
bisection to a predicted/published tokens/s ratio of 1, each row described with ``wrapopt search
--current`` exactly as ``benchmarks/torchtitan_rows.py`` describes it:

1. FSDP: the preset's GEMM fraction (``matmul_fraction``; the attention fraction is the H100 SXM's,
   carried), since the 500 W rates are an interpolation (See [Note: the 500 W H100] in
   hardware/catalog.py) and the fraction absorbs what the interpolation misses;
2. FSDP + torch.compile: ``compile_fraction`` ([Note: compile costs] in cost/fused.py);
3. FSDP + torch.compile + float8: ``float8_fraction`` ([Note: float8 costs]), tensorwise with the
   float8 all-gather and its precomputed scales, the settings TorchTitan's float8 guide gives.

Tables 3 (the same on 128 GPUs), 4 and 5 are held out. The other Hopper presets (H100 SXM, NVL,
H200) carry the two knob constants (same tensor cores, same kernels); A100 has no FP8.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile

from wrapopt.hardware import catalog

GPU = "h100-hbm2e-500w"
TABLE1 = (("FSDP", [], 5762), ("FSDP + torch.compile", ["--compile"], 6667),
          ("FSDP + torch.compile + Float8", ["--compile", "--float8", "tensorwise", "--float8-all-gather"], 8532))


def predict(config: str, flags: list[str], current: str, *, world: int, global_batch: int,
            gpu: str = GPU) -> dict:
    """The current configuration's prediction (in this process: the presets as patched), with
    tokens/s/GPU added."""
    from wrapopt.cli.main import main

    argv = ["search", f"hf:{config}", "--world-size", str(world), "--gpus-per-node", "8", "--gpu", gpu,
            "--network", "ib400", "--precision", "bf16", "--seq", "8192", "--trials", "0", "--memory", "none",
            "--global-batch", str(global_batch), *flags, "--current", current, "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc:
        raise RuntimeError(f"wrapopt {' '.join(argv)} exited {rc}")
    cur = json.loads(out.getvalue())["search"]["current"]["current"]
    return {**cur, "tokens_per_s": global_batch * 8192 / world / cur["step_s"]}


def _bisect(field: str, lo: float, hi: float, ratio, iterations: int = 14) -> float:
    """The value of the preset's ``field`` at which ``ratio()`` (pred/pub) is 1; ``ratio`` falls
    as the value rises when ``lo > hi`` is given swapped (compile_fraction: more bytes, slower)."""
    rising = ratio_at(field, hi, ratio) > ratio_at(field, lo, ratio)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if (ratio_at(field, mid, ratio) < 1.0) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def ratio_at(field: str, value: float, ratio) -> float:
    catalog.GPUS[GPU] = catalog.GPUS[GPU].with_fitted(**{field: value})
    return ratio()


def fit(config: str) -> dict[str, float]:
    """The three constants, in order: See [Note: the TorchTitan fit]."""
    out = {}
    for (_row, flags, published), field, lo, hi in zip(
            TABLE1, ("matmul_fraction", "compile_fraction", "float8_fraction"), (0.3, 0.5, 0.3), (1.0, 4.0, 1.5)):
        current = "per-block, selective-op, local batch 2" + ("" if flags else ", eager")  # eager said: compile's
        # default is the search's

        def ratio(flags=flags, published=published, current=current) -> float:
            return predict(config, flags, current, world=8, global_batch=16)["tokens_per_s"] / published
        out[field] = round(_bisect(field, lo, hi, ratio), 3)
        catalog.GPUS[GPU] = catalog.GPUS[GPU].with_fitted(**{field: out[field]})
        print(field, out[field], f"ratio {ratio():.4f}", flush=True)
    return out


def main() -> int:
    from benchmarks.torchtitan_rows import CONFIGS

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(CONFIGS["llama3.1-8b"], f)
    print(json.dumps(fit(f.name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
