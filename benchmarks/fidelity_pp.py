"""Cost-model fidelity of pipeline plans (issue 37): predicted vs measured step time at 4 ranks,
plans without a pipeline (FSDP over the 4 ranks) and with one (2 stages x 2 data-parallel ranks)
in one interleaved bench. ``--world-size 2`` runs the same at 2 ranks (FSDP over 2; 2 stages x 1),
where each rank has a core of its own on a 2-core machine, so a rank idle in the bubble lends its
core to no one. At 4 ranks on 2 cores each stage's two ranks are pinned to a core of their own
(``--pin stages``, the default; ``--pin none`` leaves them to the scheduler): unpinned, a stage
idle in the bubble lent its core to the other, whose ranks then ran at twice the speed they were
profiled at, and the PP 2 plans ran 0.80-0.95x their prediction.

Per zoo model (llama-tiny, gpt-tiny; fp32, AdamW as ``benchmarks/fidelity.py``), on 4 local gloo
ranks: the fabric and compute measured on the same ranks first (``evaluate.measure_hardware``, as
``evaluate`` does), then every plan predicted (``Simulator.simulate``, which prices a pipeline plan
with ``cost/pipeline.py``) and run for real by ``measure_plans``, interleaved (one step of each plan
per round, the order changing every round), warm-up rounds, the median over repeats of the slowest
rank's step. Every plan steps the same global batch: 4 x the zoo batch (16 sequences); a plan
without a pipeline gives each rank 4, a pipeline plan each data-parallel position 8, split by its
schedule into its micro-batches. The round also runs a second, separately built copy of the
predicted fastest plan (the A/A copy: the bench's noise floor, See [Note: A/A copy] in
wrapopt/evaluation/evaluate.py). Writes results/fidelity_pp.md and .json.

    python -m benchmarks.fidelity_pp [--models llama-tiny,gpt-tiny] [--repeats 15] [--warmup 2] [--world-size 4]

At 4 ranks it writes results/fidelity_pp.md and .json; at another world size fidelity_pp_w<N>.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch

from wrapopt.cost import Simulator
from wrapopt.evaluation.bench import measure_plans
from wrapopt.evaluation.evaluate import PLAN_SETS, measure_hardware
from wrapopt.evaluation.stats import fmt_ratio, paired_ratio, spearman
from wrapopt.fileio import atomic_write_json, atomic_write_text, fmt_bytes
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.launch import spawn
from wrapopt.models import zoo
from wrapopt.search.pipeline import pipeline_plan
from wrapopt.search.stages import balanced_split, pipeline_layout, weights
from wrapopt.spec import MeshSpec, ModelGraph, PlanSpec
from wrapopt.trace.meta import trace_model

MODELS = ["llama-tiny", "gpt-tiny"]
WORLD = 4
AA_LABEL = "A/A copy"
# Plans without a pipeline, from the fidelity bench's variants (FSDP over the 4 ranks).
PP1_LABELS = ("per-block", "groups-of-1,keep", "groups-of-2", "root-only", "no-shard")
# Pipeline plans on 2 stages x 2 data-parallel ranks: (schedule, virtual stages per rank, micro-batches, reshard).
PP2_SHAPES = (("1F1B", 1, 2, True), ("1F1B", 1, 4, True), ("GPipe", 1, 2, True), ("GPipe", 1, 4, True),
              ("1F1B", 1, 4, False), ("GPipe", 1, 2, False), ("Interleaved1F1B", 2, 4, True))


def target_loss(loss: Any, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A zoo language model's loss with torch's schedule signature (the target is the tokens)."""
    return loss(output, (target,))


def plan_set(name: str, graph: ModelGraph, sim: Simulator, world: int = WORLD) -> list[PlanSpec]:
    """The PP 1 plans, then the PP 2 plans (stages: the balanced split the search uses)."""
    mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)
    by_label = {p.label: p for p in PLAN_SETS["variants"](graph, mesh)}
    plans = [by_label[k] for k in PP1_LABELS]
    pp_mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world // 2, pp_size=2)
    layout = pipeline_layout(graph)  # gpt-tiny's tied head: See [Note: tied copies on stages]
    w, first, last = weights(graph, sim, pp_mesh.data_parallel(), layout)
    for schedule, virtual, m, reshard in PP2_SHAPES:
        sizes = balanced_split(w, first, last, 2 * virtual)
        label = f"pp2 {schedule}" + (f" x{virtual}" if virtual > 1 else "") + f" m{m}" + ("" if reshard else ",keep")
        plans.append(pipeline_plan(layout, sizes, pp_mesh, schedule=schedule, microbatches=m, reshard=reshard,
                                   checkpoint="none", tp_spec=None, label=label))
    return plans


PIN_TEXT = (", each pipeline stage's ranks pinned to one core of their own (`--pin stages`: ranks 0 and 1 on one "
            "core, 2 and 3 on the other), so ranks idle in the bubble lend their core to no one")


def pin_stage_cores(rank: int, world: int) -> list[int] | None:
    """Pin this rank's threads to one core, consecutive ranks sharing a core (ranks 0, 1 on core 0 and
    2, 3 on core 1 for 4 ranks on 2 cores), so a pipeline stage's ranks have a core of their own and a
    stage idle in the bubble lends it to no one, as on a cluster. Returns the cores, or None (no
    more ranks than cores: each rank has a core of its own already, or no affinity on this OS)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if world <= len(cores) or world % len(cores):
        return None
    mine = {cores[rank * len(cores) // world]}
    for tid in os.listdir("/proc/self/task"):  # every thread: gloo's and the intra-op pool's exist already
        os.sched_setaffinity(int(tid), mine)
    return sorted(mine)


def worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """One model's bench on this rank; rank 0 returns the rows. ``cfg``: model, repeats, warmup,
    memory (measure peaks), only (plan labels to keep, None: all), measure (False: analytical
    profiles instead of measured ones, for the structure test), pin (See ``pin_stage_cores``)."""
    import torch.distributed as dist

    pinned = pin_stage_cores(rank, world) if cfg.get("pin") else None
    name = cfg["model"]
    entry = zoo.get_entry(name)
    inputs = entry.inputs()
    t0 = time.perf_counter()
    if cfg.get("measure", True):
        # the stages' groups too: See [Note: pipeline fabric] in wrapopt/search/pipeline.py
        hw = {"quiet": cfg.get("quiet", True), "model": name, "ranks_per_node": world, "pp": 2}
        fabric, compute, _ = measure_hardware(rank, world, hw, entry, inputs, None, backend=dist.get_backend())
    else:
        fabric, compute = analytical_fabric(world_size=world), analytical_compute()
    t_hw = time.perf_counter() - t0
    graph = trace_model(entry.build("meta"), inputs, loss_fn=entry.loss)
    sim = Simulator(graph, fabric, compute)
    plans = [p for p in plan_set(name, graph, sim, world) if cfg.get("only") is None or p.label in cfg["only"]]
    preds = [sim.simulate(p) for p in plans]
    fastest = min(range(len(plans)), key=lambda i: preds[i].step_s)
    runs = plans + [replace(plans[fastest], label=AA_LABEL)]
    measured = measure_plans(lambda: entry.build("cpu", seed=0), runs,
                             lambda _d, n: entry.inputs(entry.batch * world // n), entry.loss,
                             repeats=cfg["repeats"], warmup=cfg["warmup"], measure_memory=cfg.get("memory", True),
                             pipeline_loss_fn=functools.partial(target_loss, entry.loss))
    if rank != 0:
        return None
    rows = []
    for p, e, m in zip(plans, preds, measured):
        pipe = p.pipeline
        rows.append({
            "plan": p.label, "pp": p.mesh.pp_size, "schedule": pipe.schedule if pipe else None,
            "microbatches": pipe.microbatches if pipe else 1,
            "stages": [list(s) for s in pipe.stages] if pipe else None,
            "units": len(p.units), "pred_step_s": e.step_s, "meas_step_s": m.step_s, "meas_times_s": list(m.times_s),
            "meas_spread": m.spread, "pred_peak_bytes": e.peak_bytes, "meas_peak_bytes": m.peak_bytes,
            # the step less the optimizer (a pipeline's schedule: forwards, backwards, reduction), then the optimizer
            "pred_phase_s": {"fwd_bwd": e.step_s - e.optim_s, "optim": e.optim_s},
            "meas_phase_s": {"fwd_bwd": m.phase_s[0] + m.phase_s[1], "optim": m.phase_s[2]},
            "pred_compute_s": e.compute_s, "pred_exposed_s": e.exposed_comm_s,
            # the busiest pipeline rank's actions (its stages' forwards, backwards, reductions); the makespan less
            # this is the bubble (See [Note: pipeline stages] in wrapopt/cost/pipeline.py)
            "pred_busy_s": e.fwd_s + e.bwd_s if pipe else e.step_s - e.optim_s,
            # the ranks' CPU seconds in the step over what the machine's cores give in its wall time
            "cpu_use": m.cpu_s / (m.step_s * (os.cpu_count() or 1)),
        })
    return {"model": f"zoo:{name}", "rows": rows, "aa": {"plan": plans[fastest].label,
                                                          "times_s": list(measured[-1].times_s),
                                                          "of_times_s": list(measured[fastest].times_s)},
            "fabric": fabric.to_json(), "compute": compute.to_json(), "profiles_s": t_hw,
            "machine": {"host": platform.node(), "cores": os.cpu_count(), "torch": torch.__version__,
                        "backend": dist.get_backend(), "world_size": world,
                        "threads_per_rank": torch.get_num_threads(), "pinned_by_stage": pinned is not None}}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Spearman over every plan; the predicted fastest against the measured fastest (ratio of
    medians, and paired round by round with a 90% bootstrap interval); the A/A noise floor; the
    measured / predicted step per pipeline degree."""
    rows = run["rows"]
    pred_best = min(rows, key=lambda r: r["pred_step_s"])
    meas_best = min(rows, key=lambda r: r["meas_step_s"])
    paired = ((1.0, 1.0, 1.0) if pred_best is meas_best
              else paired_ratio(pred_best["meas_times_s"], meas_best["meas_times_s"]))
    aa = paired_ratio(run["aa"]["times_s"], run["aa"]["of_times_s"])

    def rho(sel: list[dict]) -> float:
        return spearman([r["pred_step_s"] for r in sel], [r["meas_step_s"] for r in sel])

    by_pp = {pp: [r for r in rows if r["pp"] == pp] for pp in sorted({r["pp"] for r in rows})}
    return {
        "model": run["model"], "plans": len(rows), "spearman": rho(rows),
        "spearman_by_pp": {str(pp): rho(sel) for pp, sel in by_pp.items()},
        "pred_fastest": pred_best["plan"], "meas_fastest": meas_best["plan"],
        "pred_fastest_over_meas_fastest": pred_best["meas_step_s"] / meas_best["meas_step_s"],
        "paired_ratio": paired[0], "paired_ratio_ci90": [paired[1], paired[2]],
        "aa_ratio": aa[0], "aa_ratio_ci90": [aa[1], aa[2]],
        "meas_over_pred_by_pp": {str(pp): statistics.median(r["meas_step_s"] / r["pred_step_s"] for r in sel)
                                 for pp, sel in by_pp.items()},
        "median_spread": statistics.median(r["meas_spread"] for r in rows),
        "worst_mem_error": max((abs(r["pred_peak_bytes"] - r["meas_peak_bytes"]) / r["meas_peak_bytes"]
                                for r in rows if r["meas_peak_bytes"]), default=None),
    }


def _breakdown(rows: list[dict]) -> list[str]:
    """The predicted step of each plan in parts: the busiest rank's compute, the rest of its actions
    (FSDP's collectives and per-unit costs, for every micro-batch; the activation sends are not on
    it), the pipeline bubble (the makespan less that rank's actions), the optimizer; and the measured
    step against the prediction with and without the bubble."""
    out = ["", "Predicted step in parts (ms) against the measured step:", "",
           "| plan | compute (busiest rank) | collectives and per-unit costs | bubble | optimizer | measured | "
           "measured / predicted | measured / predicted without the bubble |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        make = r["pred_phase_s"]["fwd_bwd"]
        bubble = max(0.0, make - r["pred_busy_s"])
        out.append(f"| {r['plan']} | {r['pred_compute_s'] * 1e3:.1f} | "
                   f"{(r['pred_busy_s'] - r['pred_compute_s']) * 1e3:.1f} | {bubble * 1e3:.1f} | "
                   f"{r['pred_phase_s']['optim'] * 1e3:.1f} | {r['meas_step_s'] * 1e3:.1f} | "
                   f"{r['meas_step_s'] / r['pred_step_s']:.2f} | "
                   f"{r['meas_step_s'] / (r['pred_step_s'] - bubble):.2f} |")
    return out


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def render(runs: list[dict], summaries: list[dict], *, date: str, wall: float, command: str, load: dict,
           repeats: int, warmup: int) -> str:
    m = runs[0]["machine"]
    w = m["world_size"]
    lines = [
        f"# Cost-model fidelity: pipeline plans at {w} ranks (PP 1 and PP 2 mixed)", "",
        f"Machine: {m['host']}, {m['cores']} cores, no GPU; backend {m['backend']}, world size {m['world_size']}, "
        f"one thread per rank{PIN_TEXT if m.get('pinned_by_stage') else ''}; torch {m['torch']}; {date}. "
        f"Regenerate: `{command}` ({wall:.0f} s). Load average "
        f"(1, 5, 15 min) at the start: {load['start']}; at the end: {load['end']}.", "",
        f"Each model: fabric and compute measured on the same {w} ranks first (as `evaluate` does); then every plan "
        "predicted by the simulator (a pipeline plan priced by `wrapopt/cost/pipeline.py`) and run for real, "
        f"interleaved (one step of each plan per round, in an order that changes every round), {warmup} warm-up "
        f"rounds, median over {repeats} repeats of the slowest rank's step (a barrier, then the wall time of the "
        f"whole step on each rank, the largest). PP 1: FSDP over the {w} ranks. PP 2: 2 pipeline stages x {w // 2} "
        f"data-parallel ranks (FSDP on each stage's {w // 2} rank{'s' if w > 2 else ''}; Interleaved1F1B: 4 stages, "
        "2 per rank), one unit per "
        "block (`,keep`: not resharded after forward), the balanced stage split the search uses. Every plan steps "
        f"the same {w} x the zoo batch of sequences per optimizer step (fp32, AdamW). The predicted fastest is "
        "compared with the measured fastest as a ratio of medians and as the median of per-round ratios with a "
        "90% bootstrap interval; the "
        "round also runs a second copy of the predicted fastest (A/A), whose paired ratio to the original is the "
        "noise floor. Targets (issue 37): Spearman >= 0.9, predicted fastest within 5% of the measured fastest.", "",
        "| model | plans | Spearman (step) | Spearman PP 1 / PP 2 | predicted fastest | measured fastest | "
        "meas(pred fastest) / meas fastest | same, paired by round (90% CI) | noise floor: A/A, paired (90% CI) | "
        "measured / predicted, median: PP 1 / PP 2 | median spread | worst peak error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        by = s["spearman_by_pp"]
        mo = s["meas_over_pred_by_pp"]
        mem = f"{s['worst_mem_error']:.1%}" if s["worst_mem_error"] is not None else "not measured"
        lines.append(f"| {s['model']} | {s['plans']} | {s['spearman']:.2f} | {by.get('1', float('nan')):.2f} / "
                     f"{by.get('2', float('nan')):.2f} | {s['pred_fastest']} | {s['meas_fastest']} | "
                     f"{s['pred_fastest_over_meas_fastest']:.3f} | "
                     f"{fmt_ratio((s['paired_ratio'], *s['paired_ratio_ci90']))} | "
                     f"{fmt_ratio((s['aa_ratio'], *s['aa_ratio_ci90']))} | {mo.get('1', float('nan')):.2f} / "
                     f"{mo.get('2', float('nan')):.2f} | {s['median_spread']:.0%} | {mem} |")
    for run in runs:
        lines += ["", f"## {run['model']} on {run['machine']['world_size']} ranks", "",
                  f"Profiles measured in {run['profiles_s']:.0f} s. Phases: the step less the optimizer step (for a "
                  "pipeline plan the schedule: every micro-batch's forward and backward, the gradient reduction and "
                  f"the bubble), and the optimizer step. CPU use: the CPU seconds the {w} ranks' processes used in the "
                  "step (median over repeats of their sum) over the machine's cores times the measured step.", "",
                  "| plan | PP | micro-batches | predicted step (ms) | of which the busiest rank's compute (ms) | "
                  "measured step (ms) | measured / predicted | spread | measured / predicted: step less optimizer, "
                  "optimizer | CPU use | predicted peak | measured peak |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in run["rows"]:
            ph = ", ".join(f"{r['meas_phase_s'][k] / r['pred_phase_s'][k]:.2f}" for k in ("fwd_bwd", "optim"))
            meas_peak = fmt_bytes(r["meas_peak_bytes"]) if r["meas_peak_bytes"] else "not measured"
            lines.append(f"| {r['plan']} | {r['pp']} | {r['microbatches']} | {r['pred_step_s'] * 1e3:.1f} | "
                         f"{r['pred_compute_s'] * 1e3:.1f} | {r['meas_step_s'] * 1e3:.1f} | "
                         f"{r['meas_step_s'] / r['pred_step_s']:.2f} | "
                         f"{r['meas_spread']:.0%} | {ph} | {r['cpu_use']:.0%} | {fmt_bytes(r['pred_peak_bytes'])} | "
                         f"{meas_peak} |")
        stages = next((r["stages"] for r in run["rows"] if r["pp"] > 1 and r["schedule"] != "Interleaved1F1B"), None)
        if stages:
            lines += ["", "PP 2 stages: " + " | ".join(", ".join(s) for s in stages) + "."]
        lines += _breakdown(run["rows"])
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-memory", action="store_true", help="do not measure peak memory")
    ap.add_argument("--out", default="results")
    ap.add_argument("--world-size", type=int, default=WORLD, choices=(2, 4),
                    help="local ranks (2: one core per rank on this machine)")
    ap.add_argument("--pin", choices=("stages", "none"), default="stages",
                    help="stages: where ranks outnumber cores, each pipeline stage's ranks share one core")
    args = ap.parse_args()
    load = {"start": _load()}
    logs = tempfile.mkdtemp(prefix="fidelity_pp_logs_")
    print(f"ranks' logs in {logs}", file=sys.stderr)
    t0 = time.perf_counter()
    runs = []
    for name in args.models.split(","):
        cfg = {"model": name, "repeats": args.repeats, "warmup": args.warmup, "memory": not args.no_memory,
               "quiet": False, "pin": args.pin == "stages"}
        # The ranks' own output (profiler lines, library warnings) to log files: See [Note: quiet ranks] in launch.py.
        runs.append(spawn(worker, world_size=args.world_size, args=(cfg,), timeout_s=1800, log_dir=logs)[0])
        print(f"{name}: done at {time.perf_counter() - t0:.0f} s, load {_load()}", file=sys.stderr, flush=True)
    load["end"] = _load()
    wall = time.perf_counter() - t0
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    summaries = [summarize(r) for r in runs]
    command = "python -m benchmarks.fidelity_pp" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
    text = render(runs, summaries, date=date, wall=wall, command=command, load=load, repeats=args.repeats,
                  warmup=args.warmup)
    os.makedirs(args.out, exist_ok=True)
    stem = "fidelity_pp" if args.world_size == WORLD else f"fidelity_pp_w{args.world_size}"
    atomic_write_text(os.path.join(args.out, stem + ".md"), text)
    atomic_write_json(os.path.join(args.out, stem + ".json"),
                      {"date": date, "wall_s": wall, "command": command, "load": load, "summaries": summaries,
                       "runs": runs})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
