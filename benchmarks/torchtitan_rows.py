"""TorchTitan's published 2-D and 3-D rows, as their users would describe them: ``results/torchtitan.md``.

The rows: pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (torchtitan 9dec370,
torch 1963fc8, Dec 2024), Table 4 (Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, local batch 16, global
batch 512, seq 8192, full activation checkpointing, torch.compile and float8) and Table 5 (Llama 3.1
405B, 512 H100, FSDP 8 x TP 8 x PP 8, local batch 32, global batch 256, full AC, torch.compile, float8
and async TP; pipeline micro-batches = the pipeline degree, TorchTitan's default then); and, as
table "A", ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (June 2025, the same hardware): its
bf16 rows (no float8), vanilla and async TP, with torch.compile (70B: FSDP 32 x TP 8, full AC, local
batch 16; 8B: 64 GPUs, FSDP 8 x TP 8, per-op selective AC, local batch 12), which publish no memory. Each row is
described with ``wrapopt search --current`` exactly as it ran (the model's Hugging Face config, the
flags a TorchTitan user sets), in a fresh process, and the current configuration's predicted step
(tokens/s/GPU) and peak are set beside the published ones. Nothing is fitted to these rows.
Memory: TorchTitan logs the CUDA caching allocator's peak *reserved* bytes (``reserved_bytes.all.peak``,
torchtitan/metrics.py at 9dec370); wrapopt predicts the peak of live tensors
(``torch.cuda.max_memory_allocated``), which reserved bounds from above.

Run: ``python -m benchmarks.torchtitan_rows`` (about 5 minutes on 2 shared cores).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile

from benchmarks.search_pp import REPO, fresh_search

SOURCE = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (runs at torchtitan 9dec370, "
          "torch 1963fc8; 8 H100 96 GB HBM2e per host at the 500 W limit, 400 Gb/s per GPU)")
_BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
         "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16", "num_key_value_heads": 8, "hidden_act": "silu"}
CONFIGS = {  # Meta's released Llama 3.1 configs, the fields the shapes need
    "llama3.1-70b": dict(_BASE, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64),
    "llama3.1-8b": dict(_BASE, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32),
    "llama3.1-405b": dict(_BASE, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                          num_attention_heads=128),
}
SEQ = 8192
FLAGS = ["--gpus-per-node", "8", "--gpu", "h100-sxm", "--network", "ib400", "--precision", "bf16", "--seq", "8192",
         "--trials", "0", "--memory", "none"]
# (table, row, model, world, flags, --current, published tokens/s/GPU, published GiB)
ROWS = [
    ("4", "2D", "llama3.1-70b", 256, ["--tp", "8", "--global-batch", "512"],
     "per-block, full AC, local batch 16, tp 8", 829, 71.9),
    ("4", "2D + AsyncTP", "llama3.1-70b", 256, ["--tp", "8", "--global-batch", "512"],
     "per-block, full AC, local batch 16, tp 8, async TP", 876, 67.6),
    ("A", "70B bf16, vanilla TP", "llama3.1-70b", 256, ["--tp", "8", "--global-batch", "512"],
     "per-block, full AC, local batch 16, tp 8", 597.3, None),
    ("A", "70B bf16, async TP", "llama3.1-70b", 256, ["--tp", "8", "--global-batch", "512"],
     "per-block, full AC, local batch 16, tp 8, async TP", 652.4, None),
    ("A", "8B bf16, vanilla TP", "llama3.1-8b", 64, ["--tp", "8", "--global-batch", "96"],
     "per-block, selective-op, local batch 12, tp 8", 4378, None),
    ("A", "8B bf16, async TP", "llama3.1-8b", 64, ["--tp", "8", "--global-batch", "96"],
     "per-block, selective-op, local batch 12, tp 8, async TP", 4809.4, None),
    ("5", "1F1B", "llama3.1-405b", 512, ["--tp", "8", "--pp", "8", "--global-batch", "256"],
     "per-block, full AC, local batch 32, tp 8, async TP, pp 8, 1F1B, micro-batch 4", 100, 82.5),
    ("5", "Interleaved 1F1B", "llama3.1-405b", 512, ["--tp", "8", "--pp", "8", "--global-batch", "256"],
     "per-block, full AC, local batch 32, tp 8, async TP, pp 8, Interleaved1F1B, micro-batch 4", 128, 72.7),
]


def main() -> int:
    import torch

    lines = ["# TorchTitan's 2-D and 3-D rows, described as they ran", "",
             f"Source: {SOURCE}. Machine that predicted: {platform.machine()}, {os.cpu_count()} CPUs, Python "
             f"{platform.python_version()}, torch {torch.__version__}; analytical H100 SXM + 400 Gb/s InfiniBand "
             "(`--gpu h100-sxm --network ib400`: 80 GB HBM3 at 3.35 TB/s and the 700 W datasheet rates, not the "
             "rows' 96 GB HBM2e at 500 W). Each row: `wrapopt search hf:CONFIG --world-size W " + " ".join(FLAGS)
             + " FLAGS --current DESCRIPTION --json` in a fresh process; the current configuration's prediction. "
             "The rows ran with torch.compile and float8 (and Table 5 with async TP), which wrapopt does not price "
             "yet (issue 52): the predicted tokens/s/GPU are for bf16 without compile (table A's rows ran bf16 "
             "with compile: only compile is missing there). wrapopt's selective-op checkpointing keeps every "
             "matmul and attention output; TorchTitan's per-op policy recomputes every second matmul. Published "
             "memory is the caching allocator's peak reserved bytes; the prediction is the peak of live "
             "tensors.", "",
             "| table | row | GPUs | layout (--current) | published tokens/s/GPU | predicted | pred/pub | "
             "published GiB (reserved) | predicted GiB (allocated) | pred/pub |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for table, row, model, world, flags, current, tps, gib in ROWS:
            path = os.path.join(tmp, f"{model}.json")
            with open(path, "w") as f:
                json.dump(CONFIGS[model], f)
            wall, cpu, rss, data, err = fresh_search(f"hf:{path}", world, [*FLAGS, *flags, "--current", current])
            if data is None:
                why = err.strip().splitlines()[-1] if err.strip() else "failed"
                lines.append(f"| {table} | {row} | {world} | {current} | {tps:,} | failed: {why} | | "
                             f"{gib or '-'} | | |")
                print(lines[-1], flush=True)
                continue
            cur = data["search"]["current"]["current"]
            tokens = int(flags[flags.index("--global-batch") + 1]) * SEQ  # per optimizer step
            pred_tps, peak = tokens / world / cur["step_s"], cur["peak_bytes"] / 2**30
            mem = f"{gib} | {peak:.1f} | {peak / gib:.2f}" if gib else f"- | {peak:.1f} | -"
            lines.append(f"| {table} | {row} | {world} | {current} | {tps:,} | {pred_tps:,.0f} | {pred_tps / tps:.2f} "
                         f"| {mem} |")
            print(lines[-1], f"({wall:.0f} s wall, {cpu:.0f} s CPU, {rss / 1e9:.2f} GB peak RSS)", flush=True)
    out = os.path.join(REPO, "results", "torchtitan.md")
    from wrapopt.fileio import atomic_write_text

    atomic_write_text(out, "\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
