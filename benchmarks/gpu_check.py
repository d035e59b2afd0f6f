"""GPU check: the simulator against real FSDP2 steps on one GPU, in bf16.

On one device (world size 1, a process group of one rank): measure the compute
profile in bf16 (matmul rate, per-module times) and in fp32, then predict and
run plans of a ~0.5B-parameter Llama (bf16 and fp32, with and without
activation checkpointing, with and without 4 micro-batches of accumulation)
and compare the predicted step time and peak memory with the measured ones
(``torch.cuda.max_memory_allocated``, one plan resident at a time). Then the
bf16 GEMM rate at the four GEMM shapes of a block for each MPT width of
benchmarks/published.py (768 to 7168): the data its one fitted efficiency per
GPU cannot hold. Writes results/gpu.md naming the device. Takes 3-5 minutes on
an H100-class GPU.

    python -m benchmarks.gpu_check                      # on a GPU, writes results/gpu.md
    python -m benchmarks.gpu_check --device cpu --out /tmp/gpu.md   # the same code path on CPU, tiny sizes

``--device cpu`` is for hosts without CUDA (the test of this script): a tiny
model on one gloo rank, peak memory as live tensor bytes.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from dataclasses import replace

import torch

from wrapopt.cost import Simulator
from wrapopt.evaluation.bench import measure_plans
from wrapopt.fileio import atomic_write_text, fmt_bytes
from wrapopt.hardware.host import host_for
from wrapopt.hardware.measure_device import measure_compute
from wrapopt.hardware.presets import analytical_fabric
from wrapopt.hardware.timing import sync_for, time_reps
from wrapopt.launch import spawn
from wrapopt.models import zoo
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec, PlanSpec, UnitSpec
from wrapopt.trace.meta import trace_model
from wrapopt.train import TORCH_DTYPES, TrainConfig

SIZES = {  # Llama(vocab, dim, n_layers, n_heads, n_kv_heads, ffn), batch, seq
    "cuda": (dict(vocab=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, ffn=5632), 2, 2048),
    "cpu": (dict(vocab=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=128), 2, 32),
}

# The GEMM-by-width sweep (issue 20): llm-foundry's MPT widths, 125m to 30b, at a micro-batch of tokens;
# on the CPU two tiny widths run the same code path.
GEMM_WIDTHS = {"cuda": ((768, 1024, 1536, 2048, 2560, 4096, 5120, 7168), 16384), "cpu": ((64, 128), 64)}


def gemm_sweep(device: str, repeats: int = 5) -> list[dict]:
    """Achieved bf16 matmul rate at a transformer block's four GEMM shapes per width ``d`` (tokens x d
    times d x 3d, d x d, d x 4d; tokens x 4d times 4d x d), forward only: what the one fitted efficiency
    of ``benchmarks/published.py`` averages over (its 125m rows run 20% slower than it predicts)."""
    widths, tokens = GEMM_WIDTHS[device]
    sync = sync_for(torch.device(device))
    rows = []
    for d in widths:
        for name, k, n in (("qkv", d, 3 * d), ("out", d, d), ("up", d, 4 * d), ("down", 4 * d, d)):
            a = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
            t = time_reps(lambda a=a, b=b: torch.mm(a, b), repeats=repeats, warmup=2, sync=sync)
            rows.append({"width": d, "gemm": name, "m": tokens, "k": k, "n": n, "s": t,
                         "flops_per_s": 2 * tokens * k * n / t})
            del a, b
    return rows


def _cases(graph, mesh: MeshSpec) -> list[tuple[str, PlanSpec, TrainConfig]]:
    base = baselines(graph, mesh)
    per_block = base["per-block"]
    ckpt = PlanSpec(tuple(u if u.is_root else UnitSpec(u.modules, u.reshard_after_forward, True)
                          for u in per_block.units),
                    mesh, label="per-block,ckpt")
    bf16 = TrainConfig.preset("bf16")
    acc = TrainConfig.preset("bf16", grad_accumulation=4, accumulation_sync="last")
    return [
        ("per-block", per_block, bf16),
        ("per-block,ckpt", ckpt, bf16),
        ("per-block", per_block, acc),
        ("per-block,ckpt", ckpt, acc),
        ("root-only", base["root-only"], bf16),
        ("size-1e8", base["size-1e8"], bf16),
        ("per-block", per_block, TrainConfig.preset("bf16", grad_accumulation=4, accumulation_sync="every")),
        ("per-block", per_block, TrainConfig.preset("fp32")),
    ]


def _worker(rank: int, world: int, device: str, repeats: int, profile_repeats: int = 5) -> dict:
    cfg, batch, seq = SIZES[device]
    loss_fn = zoo.get_entry("llama-tiny").loss

    def build(dev: str = device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        torch.manual_seed(0)
        with torch.device(dev):
            return zoo.Llama(**cfg).to(dtype)

    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, cfg["vocab"], (batch, seq), generator=gen).to(device),)
    t0 = time.perf_counter()
    profiles = {}
    for name in ("bfloat16", "float32"):  # the compute profile in each dtype the cases compute in
        profiles[name] = measure_compute(model=build(dtype=TORCH_DTYPES[name]), example_inputs=inputs, loss_fn=loss_fn,
                                         repeats=profile_repeats)
        if device == "cuda":
            torch.cuda.empty_cache()
    profile_s = time.perf_counter() - t0
    # traced in each compute dtype, as `wrapopt estimate` traces: See [Note: tracing in the compute dtype]
    # in wrapopt/trace/record.py
    graphs = {name: trace_model(build("meta"), inputs, loss_fn=loss_fn, compute_dtype=name) for name in profiles}
    graph = graphs["float32"]
    mesh = MeshSpec(world_size=1, ranks_per_node=1, shard_size=1)
    fabric = analytical_fabric(world_size=1)  # no collective at one rank: the fabric does not enter
    rows = []
    cases = _cases(graph, mesh)
    host = None
    if device == "cuda":  # one offload plan: its peak against the prediction ([Note: CPU offload] in cost/state.py)
        host = host_for(analytical_fabric("h200+ib400", world_size=1, ranks_per_node=1), host_memory_bytes=10**12,
                        ranks_per_node=1)
        cases.append(("per-block,offload", replace(cases[0][1], offload=True, label="per-block,offload"), cases[0][2]))
    for label, plan, train in cases:
        dt = train.compute_dtype()
        est = Simulator(graphs[dt], fabric, profiles[dt], train.sim_options(), host=host).simulate(plan)
        meas = measure_plans(lambda: build(), [plan], inputs, loss_fn, repeats=repeats, warmup=2, train=train)[0]
        rows.append({"plan": label, "units": len(plan.units), "train": train.describe(), "pred_step_s": est.step_s,
                     "meas_step_s": meas.step_s, "spread": meas.spread, "pred_peak_bytes": est.peak_bytes,
                     "meas_peak_bytes": meas.peak_bytes, "breakdown": dict(est.peak_breakdown)})
        if device == "cuda":
            torch.cuda.empty_cache()
    gemms = gemm_sweep(device, repeats)
    bf = profiles["bfloat16"]
    top = sorted(bf.module_times, key=lambda t: -(t[1] + t[2]))[:10]
    return {"rows": rows, "profile_s": profile_s, "num_params": graph.num_params,
            "device_name": (torch.cuda.get_device_name() if device == "cuda"
                            else platform.processor() or platform.machine()),
            "flops": {k: p.flops_per_s for k, p in profiles.items()}, "bandwidth": bf.memory_bandwidth_bytes_per_s,
            "capacity": bf.memory_capacity_bytes, "top_modules": [list(t) for t in top], "cfg": cfg, "batch": batch,
            "seq": seq, "gemms": gemms}


def render(res: dict, *, device: str, repeats: int, wall_s: float) -> str:
    cfg = res["cfg"]
    lines = [
        f"# GPU check: {res['device_name']}",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; torch {torch.__version__}; "
        f"device {device} ({res['device_name']}); world size 1. Regenerate: `python -m benchmarks.gpu_check"
        + (" --device cpu" if device == "cpu" else "") + f"` ({wall_s:.0f} s).",
        "",
        f"Model: Llama {cfg}, {res['num_params']:,} parameters; batch {res['batch']} x {res['seq']} tokens per "
        f"micro-batch; AdamW. Compute profile measured here ({res['profile_s']:.0f} s): matmul "
        + ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in res["flops"].items())
        + f"; copy bandwidth {res['bandwidth'] / 1e9:.0f} GB/s; capacity {fmt_bytes(res['capacity'] or 0)}. "
        f"(The matmul rate is measured in bf16 on a GPU, fp32 on a CPU, whatever the profile's dtype; per-module "
        f"times are measured in the profile's dtype.)",
        "",
        f"Measured step: median of {repeats} after 2 warm-up steps; peak: `torch.cuda.max_memory_allocated` of one "
        f"step (one plan resident at a time)" if device == "cuda" else
        f"Measured step: median of {repeats} after 2 warm-up steps; peak: live tensor bytes (CPU).",
        "",
        "| plan | units | training step | predicted step (ms) | measured step (ms) | spread | measured / predicted "
        "| predicted peak | measured peak | peak error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        err = (r["pred_peak_bytes"] - r["meas_peak_bytes"]) / r["meas_peak_bytes"]
        lines.append(f"| {r['plan']} | {r['units']} | {r['train']} | {r['pred_step_s'] * 1e3:.1f} | "
                     f"{r['meas_step_s'] * 1e3:.1f} | {r['spread']:.0%} | {r['meas_step_s'] / r['pred_step_s']:.2f} | "
                     f"{fmt_bytes(r['pred_peak_bytes'])} | {fmt_bytes(r['meas_peak_bytes'])} | {err:+.1%} |")
    lines += ["", "## The ten slowest modules, bf16 (self times, forward and backward, ms)", "",
              "| module | forward | backward |", "|---|---|---|"]
    lines += [f"| {fqn or '<root>'} | {f * 1e3:.3f} | {b * 1e3:.3f} |" for fqn, f, b in res["top_modules"]]
    ref = res["flops"]["bfloat16"]
    lines += ["", f"## bf16 GEMM rate by width (issue 20: llm-foundry's MPT widths, {res['gemms'][0]['m']} tokens)", "",
              f"Median of {repeats} forward matmuls per shape; *of profile*: the rate over the compute profile's "
              f"matmul rate ({ref / 1e12:.1f} TFLOP/s), the one rate the simulator scales every GEMM by.", "",
              "| width | GEMM | m x k x n | ms | TFLOP/s | of profile |", "|---|---|---|---|---|---|"]
    lines += [f"| {g['width']} | {g['gemm']} | {g['m']} x {g['k']} x {g['n']} | {g['s'] * 1e3:.3f} | "
              f"{g['flops_per_s'] / 1e12:.3g} | {g['flops_per_s'] / ref:.2f} |" for g in res["gemms"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="results/gpu.md")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile-repeats", type=int, default=5,
                    help="repeats of each compute-profile measurement (the test passes 1)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; pass --device cpu to run the same code path on the CPU")
    t0 = time.perf_counter()
    res = spawn(_worker, world_size=1, args=(args.device, args.repeats, args.profile_repeats), timeout_s=900,
                backend="nccl" if args.device == "cuda" else "gloo")[0]
    text = render(res, device=args.device, repeats=args.repeats, wall_s=time.perf_counter() - t0)
    atomic_write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
