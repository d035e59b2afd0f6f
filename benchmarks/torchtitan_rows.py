"""TorchTitan's published rows, as their users would describe them: ``results/torchtitan.md`` and the
TorchTitan section of ``results/published.md``.

The rows: pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (torchtitan 9dec370,
torch 1963fc8, Dec 2024), Tables 1 and 3 (Llama 3.1 8B, FSDP on 8 and 128 GPUs, local batch 2,
selective AC: FSDP, + torch.compile, + torch.compile + float8; Table 1 and Table 2's 32768-token row
are the preset's fit set, [Note: the TorchTitan fit] in benchmarks/torchtitan_fit.py), Table 4 (Llama 3.1 70B, 256
H100, FSDP 32 x TP 8, local batch 16, global batch 512, seq 8192, full activation checkpointing,
torch.compile and float8) and Table 5 (Llama 3.1 405B, 512 H100, FSDP 8 x TP 8 x PP 8, local batch
32, global batch 256, full AC, torch.compile, float8 and async TP; pipeline micro-batches = the
pipeline degree, TorchTitan's default then); and, as table "A",
``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (June 2025, the same hardware): its bf16
rows (no float8), vanilla and async TP, with torch.compile (70B: FSDP 32 x TP 8, full AC, local
batch 16; 8B: 64 GPUs, FSDP 8 x TP 8, per-op selective AC, local batch 12), which publish no memory.
Each row is described with ``wrapopt search --current`` exactly as it ran (the model's Hugging Face
config, the flags a TorchTitan user sets: ``--compile``, ``--float8 tensorwise --float8-all-
gather``), on the ``h100-hbm2e-500w`` preset (the rows' hardware), and the current configuration's
predicted step (tokens/s/GPU), peak and compute split by kernel class are set beside the published
ones. Nothing else here is fitted. Memory: TorchTitan logs the CUDA caching allocator's peak
*reserved* bytes (``reserved_bytes.all.peak``, torchtitan/metrics.py at 9dec370); wrapopt predicts
the peak of live tensors (``torch.cuda.max_memory_allocated``), which reserved bounds from above.

Run: ``python -m benchmarks.torchtitan_rows`` (one process; about 5 minutes on 2 shared cores).
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
GPU = "h100-hbm2e-500w"
FLAGS = ["--gpus-per-node", "8", "--gpu", GPU, "--network", "ib400", "--precision", "bf16", "--seq", "8192",
         "--trials", "0", "--memory", "none"]
KNOBS = ["--compile", "--float8", "tensorwise", "--float8-all-gather"]
_T1 = "per-block, selective-op, local batch 2"
# (table, row, model, world, flags, --current, published tokens/s/GPU, published GiB)
ROWS = [
    ("1", "FSDP", "llama3.1-8b", 8, ["--global-batch", "16"], _T1 + ", eager", 5762, 82.4),
    ("1", "FSDP + torch.compile", "llama3.1-8b", 8, ["--global-batch", "16", "--compile"], _T1, 6667, 77.0),
    ("1", "FSDP + torch.compile + Float8", "llama3.1-8b", 8, ["--global-batch", "16", *KNOBS], _T1, 8532, 76.8),
    ("3", "FSDP", "llama3.1-8b", 128, ["--global-batch", "256"], _T1 + ", eager", 5605, 67.0),
    ("3", "FSDP + torch.compile", "llama3.1-8b", 128, ["--global-batch", "256", "--compile"], _T1, 6514, 62.0),
    ("3", "FSDP + torch.compile + Float8", "llama3.1-8b", 128, ["--global-batch", "256", *KNOBS], _T1, 8380, 61.8),
    ("4", "2D", "llama3.1-70b", 256, ["--tp", "8", "--global-batch", "512", *KNOBS],
     "per-block, full AC, local batch 16, tp 8", 829, 71.9),
    ("4", "2D + AsyncTP", "llama3.1-70b", 256, ["--tp", "8", "--global-batch", "512", *KNOBS],
     "per-block, full AC, local batch 16, tp 8, async TP", 876, 67.6),
    ("A", "70B bf16, vanilla TP", "llama3.1-70b", 256, ["--tp", "8", "--global-batch", "512", "--compile"],
     "per-block, full AC, local batch 16, tp 8", 597.3, None),
    ("A", "70B bf16, async TP", "llama3.1-70b", 256, ["--tp", "8", "--global-batch", "512", "--compile"],
     "per-block, full AC, local batch 16, tp 8, async TP", 652.4, None),
    ("A", "8B bf16, vanilla TP", "llama3.1-8b", 64, ["--tp", "8", "--global-batch", "96", "--compile"],
     "per-block, selective-op, local batch 12, tp 8", 4378, None),
    ("A", "8B bf16, async TP", "llama3.1-8b", 64, ["--tp", "8", "--global-batch", "96", "--compile"],
     "per-block, selective-op, local batch 12, tp 8, async TP", 4809.4, None),
    ("5", "1F1B", "llama3.1-405b", 512, ["--tp", "8", "--pp", "8", "--global-batch", "256", *KNOBS],
     "per-block, full AC, local batch 32, tp 8, async TP, pp 8, 1F1B, micro-batch 4", 100, 82.5),
    ("5", "Interleaved 1F1B", "llama3.1-405b", 512, ["--tp", "8", "--pp", "8", "--global-batch", "256", *KNOBS],
     "per-block, full AC, local batch 32, tp 8, async TP, pp 8, Interleaved1F1B, micro-batch 4", 128, 72.7),
]
CLASSES = ("GEMM", "GEMM fp8", "attention", "memory-bound")


class _Recorder:
    """The first current-configuration estimate of one search and the simulators under it (their
    graphs and compute as priced), for the compute split: See ``split``."""

    def __init__(self) -> None:
        self.depth, self.sims, self.est, self.done = 0, [], None, False

    def install(self) -> None:
        sim_mod = sys.modules["wrapopt.cost.simulate"]

        orig, rec = sim_mod.Simulator.simulate, self

        def simulate(sim, plan, **kw):  # noqa: ANN001, ANN202
            mine = not rec.done and str(plan.label).startswith("current")
            if mine and rec.depth == 0:  # the outermost: the whole model, as priced before any view
                rec.sims.append((sim, plan))
            rec.depth += mine
            try:
                est = orig(sim, plan, **kw)
            finally:
                rec.depth -= mine
            if mine and rec.depth == 0:
                rec.est, rec.done = est, True
            return est
        sim_mod.Simulator.simulate = simulate

    def split(self) -> dict[str, float]:
        """Share of the compute seconds per kernel class (forward, backward, and the recompute: the
        whole forward under full AC, the memory-bound ops and every second mm under selective-op), over the whole model
        as the outermost simulator prices it (a tensor-parallel or pipeline view divides every class
        alike), and exposed communication's share of the step."""
        from wrapopt.cost.roofline import kernel_times

        out = dict.fromkeys(CLASSES, 0.0)
        for sim, plan in self.sims:
            ckpt = {m: u.checkpoint for u in plan.units for m in u.modules}
            for m in sim.graph.modules:
                mode = next((ckpt[a] for a in _ancestry(m.fqn) if a in ckpt and ckpt[a]), False)
                for k, (f, b) in kernel_times(m, sim.compute).items():
                    again = f if mode is True or (mode and k == "memory-bound") else (
                        f * m.selective_mm_recompute if mode and k.startswith("GEMM") else 0.0)
                    out[k] = out.get(k, 0.0) + f + b + again
        total = sum(out.values()) or 1.0
        shares = {k: v / total for k, v in out.items()}
        shares["exposed comm"] = self.est.exposed_comm_s / self.est.step_s if self.est else float("nan")
        return shares


def _ancestry(fqn: str) -> list[str]:
    parts = fqn.split(".") if fqn else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def predict(config: str, world: int, flags: list[str], current: str) -> tuple[dict, dict[str, float]]:
    """(the current configuration's JSON, its compute split) of one search, in this process."""
    from wrapopt.cli.main import main as cli
    import wrapopt.cost.simulate  # noqa: F401 - the module, not the function wrapopt.cost exports

    sim_mod = sys.modules["wrapopt.cost.simulate"]

    orig, rec = sim_mod.Simulator.simulate, _Recorder()
    rec.install()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = cli(["search", f"hf:{config}", "--world-size", str(world), *FLAGS, *flags, "--current", current,
                      "--json"])
    finally:
        sim_mod.Simulator.simulate = orig
    if rc:
        raise RuntimeError(f"exit {rc}")
    return json.loads(out.getvalue())["search"]["current"]["current"], rec.split()


def main() -> int:
    import torch

    lines = ["# TorchTitan's published rows, described as they ran", "",
             f"Source: {SOURCE}. Machine that predicted: {platform.machine()}, {os.cpu_count()} CPUs, Python "
             f"{platform.python_version()}, torch {torch.__version__}; the `{GPU}` preset (96 GB HBM2e at 2.4 TB/s, "
             "the 500 W rates interpolated: [Note: the 500 W H100] in wrapopt/hardware/catalog.py) + 400 Gb/s "
             "InfiniBand. Each row: `wrapopt search hf:CONFIG --world-size W " + " ".join(FLAGS)
             + " FLAGS --current DESCRIPTION --json`, one process for all rows; the current configuration's "
             "prediction. Table 1 and Table 2's 32768-token row (results/torchtitan_cp.md) are the fit set of the "
             "preset's GEMM, attention and knob constants, one each ([Note: the TorchTitan fit] in "
             "benchmarks/torchtitan_fit.py); Tables 3, 4, 5 and A are held out. "
             "Float8 rows: tensorwise with the float8 all-gather (TorchTitan's float8 guide); eager rows say "
             "`eager` (compile's default is the search's). Selective-op is TorchTitan's per-op policy (every "
             "second matmul recomputed: [Note: selective checkpointing] in wrapopt/selective.py); compiled, the "
             "outputs only additions read are not kept ([Note: compile keeps what backward reads]). Published "
             "memory is the caching allocator's peak reserved bytes; "
             "the prediction is the peak of live tensors. Split: the share of compute seconds per kernel class "
             "(forward, backward, recompute) and exposed communication's share of the step.", "",
             "| table | row | GPUs | layout (--current) | flags | published tokens/s/GPU | predicted | pred/pub | "
             "published GiB (reserved) | predicted GiB (allocated) | pred/pub | GEMM bf16 | GEMM fp8 | attention | "
             "memory-bound | exposed comm |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for table, row, model, world, flags, current, tps, gib in ROWS:
            path = os.path.join(tmp, f"{model}.json")
            with open(path, "w") as f:
                json.dump(CONFIGS[model], f)
            knobs = " ".join(x for x in flags if x.startswith("--") and x not in ("--tp", "--pp", "--global-batch"))
            knobs = knobs.replace("--float8 ", "--float8 tensorwise ").strip() if "--float8" in knobs else knobs
            try:
                cur, split = predict(path, world, flags, current)
            except Exception as e:  # noqa: BLE001 - a row that fails is reported, the others still run
                lines.append(f"| {table} | {row} | {world} | {current} | {knobs} | {tps:,} | failed: {e} | | "
                             f"{gib or '-'} | | | | | | | |")
                print(lines[-1], flush=True)
                continue
            tokens = int(flags[flags.index("--global-batch") + 1]) * SEQ  # per optimizer step
            pred_tps, peak = tokens / world / cur["step_s"], cur["peak_bytes"] / 2**30
            mem = f"{gib} | {peak:.1f} | {peak / gib:.2f}" if gib else f"- | {peak:.1f} | -"
            cls = " | ".join(f"{split[k]:.0%}" for k in (*CLASSES, "exposed comm"))
            lines.append(f"| {table} | {row} | {world} | {current} | {knobs or '-'} | {tps:,} | {pred_tps:,.0f} | "
                         f"{pred_tps / tps:.2f} | {mem} | {cls} |")
            print(lines[-1], flush=True)
    from wrapopt.fileio import atomic_write_text

    atomic_write_text(os.path.join(REPO, "results", "torchtitan.md"), "\n".join(lines) + "\n")
    _published_section(lines)
    return 0


BEGIN, END = "<!-- torchtitan: benchmarks/torchtitan_rows.py writes this section -->", "<!-- /torchtitan -->"


def _published_section(lines: list[str]) -> None:
    """The TorchTitan section of ``results/published.md``, between its markers (appended once)."""
    from wrapopt.fileio import atomic_write_text

    path = os.path.join(REPO, "results", "published.md")
    with open(path) as f:
        text = f.read()
    section = "\n".join([BEGIN, "## TorchTitan (Llama 3.1, H100 96 GB at 500 W): Tables 1, 3, 4, 5", "",
                         *lines[2:], "", END])
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write_text(path, text)
    print(f"wrote results/torchtitan.md and the TorchTitan section of {path}")


if __name__ == "__main__":
    sys.exit(main())
