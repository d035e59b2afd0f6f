"""Cost-model fidelity on a mixture-of-experts model: predicted vs measured step time and
peak memory of a small Hugging Face Mixtral (``hf:`` config, 8 experts, top-2) on local
gloo ranks, the reduced protocol of ``benchmarks/fidelity.py`` (one screening round, no
confirmation round).

The plans: the ``variants`` plan set of the dense models (baselines; groups of 1, 2, 4
blocks with and without resharding and checkpointing; prefetch), plus units that hold
each block's experts alone (See [Note: experts on meta] in wrapopt/trace/ops.py: the
trace runs the grouped-matmul experts on meta; the measured CPU model runs transformers'
"eager" experts, the CPU grouped matmul having no float32 backward; both compute the
routed (token, expert) pairs only). With expert parallelism over every rank (ep = world,
efsdp 1; See [Note: expert parallel costs] in wrapopt/cost/ep.py): wrapopt's choice among
the ep plans (``run_search`` with ``--ep N``) and the fully sharded plans above with ``ep_size`` set.
The variants' selective-op rows are left out: torch's selective checkpoint cannot replay
transformers' eager experts, whose loop runs over the experts the routing hit ("aten.slice.Tensor
invocation ... not found in storage" in backward, with or without expert parallelism).
Writes results/fidelity_moe.md and .json.

    python -m benchmarks.fidelity_moe [--world-size 2] [--repeats 7] [--layers 4]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
from dataclasses import replace

import torch

from wrapopt.cost.simulate import Simulator
from wrapopt.evaluation.bench import measure_plans
from wrapopt.evaluation.evaluate import PLAN_SETS
from wrapopt.evaluation.stats import spearman
from wrapopt.fileio import atomic_write_json, atomic_write_text, fmt_bytes
from wrapopt.hardware.measure_collectives import measure_fabric
from wrapopt.hardware.measure_device import measure_compute
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.launch import broadcast_json, spawn
from wrapopt.models.sources import resolve_model
from wrapopt.search.baselines import baselines
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.search.run import run_search
from wrapopt.spec import SELECTIVE_OP, MeshSpec, ParallelRequest, PlanSpec, UnitSpec
from wrapopt.trace.meta import trace_model


def write_config(directory: str, layers: int) -> str:
    import transformers

    cfg = transformers.MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=1024, max_position_embeddings=256,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     architectures=["MixtralForCausalLM"])
    path = os.path.join(directory, "mixtral-moe-small.json")
    cfg.to_json_file(path)
    return path


def own_loss(out, _inputs):
    return out.loss


def expert_plans(graph, mesh: MeshSpec) -> list[PlanSpec]:
    """Each block's experts as their own unit (the block keeps attention and router), and
    the experts alone with the rest in the root."""
    root = baselines(graph, mesh)["root-only"].units[-1]
    blocks = [b for chain in graph.block_chains for b in chain]
    experts = [m.fqn for m in graph.modules if m.cls.endswith("Experts")]
    inner = tuple(UnitSpec((e,)) for e in experts)
    return [PlanSpec(inner + tuple(UnitSpec((b,)) for b in blocks) + (root,), mesh, label="experts+blocks"),
            PlanSpec(inner + (root,), mesh, label="experts-only"),
            PlanSpec(tuple(UnitSpec((e,), False) for e in experts) + tuple(UnitSpec((b,)) for b in blocks) + (root,),
                     mesh, label="experts,keep+blocks")]


EP_OF = ("per-block", "groups-of-2", "groups-of-1,ckpt", "groups-of-4,keep", "size-1e8", "experts+blocks")


def ep_plans(graph, sim: Simulator, mesh: MeshSpec, plans: list[PlanSpec]) -> list[PlanSpec]:
    """Expert parallelism over every rank: wrapopt's best ep plan, and the plans named in ``EP_OF``
    (fully sharded) with ``ep_size`` set."""
    ep = mesh.world_size
    best = run_search(graph, sim, ParallelRequest(mesh=mesh, ep=ep), memory_budget=None,
                      options=SearchOptions(trials=0)).result.best.plan
    out = [replace(best, label="wrapopt:" + best.label)]
    for p in plans:
        if p.label in EP_OF and p.mesh.shard_size == mesh.world_size:
            out.append(replace(p, mesh=replace(p.mesh, ep_size=ep), label=f"{p.label} + ep{ep}"))
    return out


def measured_model(src):
    """The CPU model, without the key-value cache: measure_compute's checkpoint probe calls a
    block again with the keyword arguments it captured, and a DynamicCache among them would
    grow across calls (the trace keeps the config's cache; it adds no bytes there: the cache
    holds the keys and values attention saves anyway)."""
    model = src.build("cpu")
    model.config.use_cache = False
    return model


def worker(rank: int, world: int, path: str, batch: int, seq: int, repeats: int) -> dict | None:
    src = resolve_model(f"hf:{path}", batch=batch, seq=seq)
    fabric = measure_fabric(sizes_bytes=tuple(4 ** k * 1024 for k in range(0, 7)), repeats=5, progress=False)
    compute = measure_compute(model=measured_model(src), example_inputs=src.inputs, loss_fn=own_loss, repeats=5)
    compute = broadcast_json(compute.to_json(), ComputeProfile.from_json)
    graph = trace_model(src.build("meta"), src.inputs)
    mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)
    sim = Simulator(graph, fabric, compute)
    chosen = search_plan(graph, sim, mesh).best.plan
    plans = [replace(chosen, label="wrapopt:" + (chosen.label or "plan"))]
    seen = {(chosen.units, chosen.mesh, chosen.forward_prefetch)}
    for p in PLAN_SETS["variants"](graph, mesh) + expert_plans(graph, mesh):
        if any(u.checkpoint == SELECTIVE_OP for u in p.units):
            continue  # torch's selective checkpoint cannot replay the eager experts' data-dependent loop
        if (p.units, p.mesh, p.forward_prefetch) not in seen:
            seen.add((p.units, p.mesh, p.forward_prefetch))
            plans.append(p)
    plans += ep_plans(graph, sim, mesh, plans)
    preds = [sim.simulate(p) for p in plans]
    measured = measure_plans(lambda: measured_model(src), plans, src.inputs, own_loss, repeats=repeats, warmup=2)
    if rank != 0:
        return None
    return {"params": graph.num_params, "estimates": list(graph.estimates), "rows": [
        {"plan": p.label, "units": len(p.units), "pred_step_s": e.step_s, "meas_step_s": m.step_s,
         "meas_spread": m.spread, "pred_peak_bytes": e.peak_bytes, "meas_peak_bytes": m.peak_bytes}
        for p, e, m in zip(plans, preds, measured)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    args = ap.parse_args()
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        path = write_config(d, args.layers)
        res = spawn(worker, world_size=args.world_size, args=(path, args.batch, args.seq, args.repeats),
                    timeout_s=1800)[0]
    wall, load = time.perf_counter() - t0, (load0, os.getloadavg()[0])  # others' work on the same cores
    rows = res["rows"]
    rho = spearman([r["pred_step_s"] for r in rows], [r["meas_step_s"] for r in rows])
    pred_fast = min(rows, key=lambda r: r["pred_step_s"])
    meas_fast = min(rows, key=lambda r: r["meas_step_s"])
    peak_errs = [abs(r["pred_peak_bytes"] - r["meas_peak_bytes"]) / r["meas_peak_bytes"] for r in rows]
    cmd = (f"python -m benchmarks.fidelity_moe --world-size {args.world_size} --repeats {args.repeats} "
           f"--layers {args.layers} --batch {args.batch} --seq {args.seq}")
    summary = {"spearman": rho, "pred_fastest": pred_fast["plan"], "meas_fastest": meas_fast["plan"],
               "meas_pred_fastest_over_meas_fastest": pred_fast["meas_step_s"] / meas_fast["meas_step_s"],
               "worst_peak_error": max(peak_errs), "median_peak_error": sorted(peak_errs)[len(peak_errs) // 2]}
    machine = {"host": platform.node(), "cores": os.cpu_count(), "cpu": platform.machine(), "torch": torch.__version__,
               "backend": "gloo", "world_size": args.world_size, "threads_per_rank": 1}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    import transformers

    out = {"date": date, "command": cmd, "wall_s": wall, "load_average": load, "machine": machine,
           "transformers": transformers.__version__,
           "model": "hf:Mixtral (8 experts, top-2)", "params": res["params"], "summary": summary, "rows": rows,
           "trace_estimates": res["estimates"]}
    lines = ["# Cost-model fidelity: a mixture-of-experts model", "",
             f"Machine: {machine['host']}, {machine['cores']} cores ({machine['cpu']}), no GPU; gloo, "
             f"{args.world_size} ranks, one thread per rank; torch {machine['torch']}, transformers "
             f"{out['transformers']}; {date}. Command: `{cmd}` ({wall:.0f} s; load average {load[0]:.1f} at "
             f"the start, {load[1]:.1f} at the end, on {machine['cores']} cores).", "",
             f"Model: Hugging Face Mixtral from a config ({res['params'] / 1e6:.2f} M parameters: {args.layers} "
             f"layers, width 128, 8 experts of width 256, top-2), batch {args.batch} x {args.seq} tokens per rank, its "
             f"own loss. Traced on meta with the grouped-matmul experts; measured with transformers' eager experts "
             "(the CPU grouped matmul has no float32 backward). Plans `+ ep2` split the experts over both ranks "
             "(expert parallelism, efsdp 1: tokens dispatched and combined by all-to-all). Reduced protocol: "
             "fabric and compute measured on the "
             f"same ranks, then every plan run for real, interleaved, 2 warm-up rounds, median of {args.repeats} "
             f"repeats of the slowest rank's step; no confirmation round. Peak: live tensor bytes, max over ranks.", "",
             f"Spearman (predicted vs measured step): **{rho:.2f}**; predicted fastest {pred_fast['plan']}, measured "
             f"fastest {meas_fast['plan']}, measured ratio {summary['meas_pred_fastest_over_meas_fastest']:.3f}; peak "
             f"error worst {summary['worst_peak_error']:.1%}, median {summary['median_peak_error']:.1%}.", "",
             "| plan | units | predicted step | measured step (spread) | predicted peak | measured peak | peak error |",
             "|---|---|---|---|---|---|---|"]
    for r, err in zip(rows, peak_errs):
        lines.append(f"| {r['plan']} | {r['units']} | {r['pred_step_s'] * 1e3:.1f} ms | {r['meas_step_s'] * 1e3:.1f} "
                     f"ms ({r['meas_spread']:.0%}) | {fmt_bytes(r['pred_peak_bytes'])} | "
                     f"{fmt_bytes(r['meas_peak_bytes'])} | {err:.1%} |")
    os.makedirs(args.out, exist_ok=True)
    atomic_write_json(os.path.join(args.out, "fidelity_moe.json"), out)
    atomic_write_text(os.path.join(args.out, "fidelity_moe.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
