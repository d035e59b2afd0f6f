"""TorchTitan's context-parallel rows (Table 2), as their users would describe them: ``results/torchtitan_cp.md``.

The rows: pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` Table 2 (Llama 3.1 8B, 8
H100, local batch 1, full activation checkpointing, torch.compile and float8): FSDP 8 / CP 1 at
32768 tokens, FSDP 4 / CP 2 at 65536 and FSDP 2 / CP 4 at 131072 (the 262144 row exceeds the
config's 131072 positions). Each row is described with ``wrapopt search --current`` as it ran (``cp
N``, ``--cp N``), on the ``h100-hbm2e-500w`` preset, with the flags and recorder of
``benchmarks/torchtitan_rows.py``. The 32768-token row fits the preset's attention fraction (with
Table 1 fitting the other three constants, jointly: [Note: the TorchTitan fit] in
benchmarks/torchtitan_fit.py); the 65536 and 131072 rows are held out.
Tokens per step: the data-parallel ranks (8 / cp) x 1 sequence x the sequence length. Then ``--cp
auto`` on the 131072 row: the degree the search chooses and whether its plan fits the budget; and
``--cp auto --pp auto`` there: each pipeline degree with each cp degree.

Run: ``python -m benchmarks.torchtitan_cp`` (one process; about 2 minutes on 2 shared cores).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import sys
import tempfile

from benchmarks.search_pp import REPO
from benchmarks.torchtitan_rows import CLASSES, CONFIGS, FLAGS, GPU, KNOBS, SOURCE, predict

MODEL = "llama3.1-8b"
# (row, sequence length, cp degree, published tokens/s/GPU, published GiB)
ROWS = [("FSDP 8, CP 1", 32768, 1, 3890, 83.9), ("FSDP 4, CP 2", 65536, 2, 2540, 84.2),
        ("FSDP 2, CP 4", 131072, 4, 1071, 84.0)]
_CURRENT = "per-block, full AC, local batch 1"


def _flags(seq: int, cp: int) -> list[str]:
    """The rows' flags at ``seq`` tokens (FLAGS fixes 8192; the row's length replaces it)."""
    flags = list(FLAGS)
    flags[flags.index("--seq") + 1] = str(seq)
    return [*flags, "--batch", "1", *KNOBS, *(["--cp", str(cp)] if cp > 1 else [])]


def auto_choice(path: str, seq: int, world: int = 8, *, pp: bool = False) -> dict:
    """``--cp auto`` (with ``--pp auto`` when ``pp``) at ``seq``: the chosen plan's mesh, step, peak and
    whether it fits (90% of 96 GB), each degree's row, and each pipeline degree's best row."""
    from wrapopt.cli.main import main as cli

    flags = [x for x in _flags(seq, 1) if x not in ("--memory", "none")] + (["--pp", "auto"] if pp else [])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli(["search", f"hf:{path}", "--world-size", str(world), *flags, "--cp", "auto", "--json"])
    if rc:
        raise RuntimeError(f"exit {rc}")
    data = json.loads(out.getvalue())
    pred, budget = data["prediction"], data["search"]["memory_budget"]
    return {"mesh": data["mesh"], "label": data["label"], "step_s": pred["step_s"], "peak_bytes": pred["peak_bytes"],
            "budget": budget, "fits": budget is None or pred["peak_bytes"] <= budget,
            "rows": [(r["row"], r["step_s"], r["peak_bytes"], r["fits"]) for r in data["search"]["tp_rows"]],
            "pipeline": (data["search"].get("pipeline") or {}).get("rows", []),
            "tried": (data["search"].get("pipeline") or {}).get("tried", [])}


def main() -> int:
    import torch

    lines = ["# TorchTitan's context-parallel rows (Table 2), described as they ran", "",
             f"Source: {SOURCE}, Table 2 (Llama 3.1 8B, 8 GPUs, local batch 1, full AC, torch.compile + float8). "
             f"Machine that predicted: {platform.machine()}, {os.cpu_count()} CPUs, Python "
             f"{platform.python_version()}, torch {torch.__version__}; the `{GPU}` preset + 400 Gb/s InfiniBand. Each "
             "row: `wrapopt search hf:CONFIG --world-size 8 " + " ".join(_flags(0, 1)).replace("--seq 0", "--seq S")
             + " [--cp N] --current DESCRIPTION --json`, one process for all rows; the current configuration's "
             "prediction ([Note: context parallel costs] in wrapopt/cost/cp.py). The 32768 row is in the preset's "
             "fit set (its attention fraction, jointly with Table 1: [Note: the TorchTitan fit] in "
             "benchmarks/torchtitan_fit.py); the 65536 and 131072 rows are held out. Tokens per step: "
             "8 / cp data-parallel ranks x 1 sequence x S. Published memory is the caching allocator's peak reserved "
             "bytes; the prediction is the peak of live tensors. Split: as results/torchtitan.md.", "",
             "| row | seq | layout (--current) | published tokens/s/GPU | predicted | pred/pub | published GiB "
             "(reserved) | predicted GiB (allocated) | pred/pub | GEMM bf16 | GEMM fp8 | attention | memory-bound | "
             "exposed comm |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{MODEL}.json")
        with open(path, "w") as f:
            json.dump(CONFIGS[MODEL], f)
        for row, seq, cp, tps, gib in ROWS:
            current = _CURRENT + (f", cp {cp}" if cp > 1 else "")
            try:
                cur, split = predict(path, 8, _flags(seq, cp), current)
            except Exception as e:  # noqa: BLE001 - a row that fails is reported, the others still run
                lines.append(f"| {row} | {seq} | {current} | {tps:,} | failed: {e} | | {gib} | | | | | | | |")
                print(lines[-1], flush=True)
                continue
            pred_tps, peak = (8 // cp) * seq / 8 / cur["step_s"], cur["peak_bytes"] / 2**30
            cls = " | ".join(f"{split[k]:.0%}" for k in (*CLASSES, "exposed comm"))
            lines.append(f"| {row} | {seq} | {current} | {tps:,} | {pred_tps:,.0f} | {pred_tps / tps:.2f} | {gib} | "
                         f"{peak:.1f} | {peak / gib:.2f} | {cls} |")
            print(lines[-1], flush=True)
        auto = auto_choice(path, 131072)
        piped = auto_choice(path, 131072, pp=True)
    mesh = auto["mesh"]
    cp = mesh.get("cp_size", 1)
    lines += ["", "## --cp auto at 131072 tokens on 8 H100 (memory budget auto: 90% of 96 GB)", "",
              f"Chosen: cp {cp}, shard group {mesh['shard_size']} ({auto['label']}), predicted step "
              f"{auto['step_s']:.2f} s ({(8 // cp) * 131072 / 8 / auto['step_s']:,.0f} tokens/s/GPU), peak "
              f"{auto['peak_bytes'] / 2**30:.1f} GiB of a {auto['budget'] / 2**30:.1f} GiB budget, fits: "
              f"{auto['fits']}. Each degree's best (a degree's step runs 1/cp of the tokens per GPU):", "",
              "| degree | predicted step | tokens/s/GPU | peak GiB | fits |", "|---|---|---|---|---|"]
    for label, step, peak, fits in auto["rows"]:
        c = int(label.split("cp")[1].split()[0]) if label.startswith("best cp") else 1
        lines.append(f"| {label} | {step:.2f} s | {(8 // c) * 131072 / 8 / step:,.0f} | {peak / 2**30:.1f} | "
                     f"{fits} |")
    pmesh = piped["mesh"]
    lines += ["", "## --cp auto --pp auto at 131072 tokens (each pipeline degree with each cp degree)", "",
              f"Chosen: pp {pmesh.get('pp_size', 1)}, cp {pmesh.get('cp_size', 1)} ({piped['label']}), predicted "
              f"step {piped['step_s']:.2f} s, peak {piped['peak_bytes'] / 2**30:.1f} GiB, fits: {piped['fits']}. "
              "Each pipeline degree's best over its cp degrees, compared per token (See [Note: cp in a pipeline] in "
              "wrapopt/search/shapes.py); wrapopt prices and exports these plans, and its own pipeline apply "
              "refuses cp:", "", "| row | pp | cp | predicted step | tokens/s/GPU | peak GiB | fits |",
              "|---|---|---|---|---|---|---|"]
    for r in piped["pipeline"]:
        c = r.get("cp_size", 1)
        lines.append(f"| {r['row']} | {r['pp_size']} | {c} | {r['step_s']:.2f} s | "
                     f"{(8 // c) * 131072 / 8 / r['step_s']:,.0f} | {r['peak_bytes'] / 2**30:.1f} | {r['fits']} |")
    lines += ["", "What became of each pipeline degree: " + "; ".join(f"pp{t['pp']}: {t['outcome']}"
                                                                    for t in piped["tried"])]
    print("\n".join(lines[-16:]), flush=True)
    from wrapopt.fileio import atomic_write_text

    atomic_write_text(os.path.join(REPO, "results", "torchtitan_cp.md"), "\n".join(lines) + "\n")
    print("wrote results/torchtitan_cp.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
