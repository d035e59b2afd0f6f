"""Cost-model fidelity: predicted vs measured step time and peak memory.

For each trainable zoo model, on local gloo ranks, at least 8 distinct plans
(the baselines; groups of 1, 2, 4 blocks; with and without resharding after
forward; with and without activation checkpointing; explicit prefetch) are
predicted by the simulator and run for real, interleaved, median over
repeats. Then the FSDPMemTracker check of llama-7b on a fake process group
of 8 ranks, and the simulator's speed. Writes results/fidelity.md, results/fidelity.json and
results/fidelity_scatter.png, and adds the run's summary to results/fidelity_history.json/.md
(every run's verdicts side by side).

    python -m benchmarks.fidelity [--world-sizes 2,4] [--repeats 15] [--confirm 3] [--models gpt-tiny,...]
                                  [--cases fp32,bf16,accum4]

Each case is a training step: ``fp32`` (the model as it is, one batch), ``bf16``
(bf16 parameters and compute, fp32 reduction; module times measured in bf16) and
``accum4`` (4 micro-batches per step, synchronised on the last only); its rows
carry the case in the model column, e.g. ``zoo:gpt-tiny [bf16]``.
    python -m benchmarks.fidelity --add-to-history old/fidelity.json ...   # measure nothing
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time

from benchmarks.sim_speed import simulator_speed
from wrapopt.evaluation.bench import PHASES
from wrapopt.evaluation.evaluate import evaluate
from wrapopt.evaluation.stats import (
    fmt_ratio,
    fmt_steal,
    noise_floor,
    paired_ratio,
    place_effect,
    spearman,
)
from wrapopt.fileio import atomic_write_json, atomic_write_text, fmt_bytes
from wrapopt.train import TrainConfig

TRAINABLE = ["gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny"]
CASES = {  # name -> the TrainConfig of the case (None: fp32, one batch, as before the cases existed)
    "fp32": None,
    "bf16": TrainConfig.preset("bf16"),
    "accum4": TrainConfig(grad_accumulation=4, accumulation_sync="last"),
    "accum4-every": TrainConfig(grad_accumulation=4, accumulation_sync="every"),
    "bf16-accum4": TrainConfig.preset("bf16", grad_accumulation=4, accumulation_sync="last"),
}


def fake_tracker_check(world_size: int = 8) -> list[dict]:
    """llama-7b plans: simulator (GPU semantics) vs FSDPMemTracker on fake tensors."""
    from wrapopt.cost import Simulator
    from wrapopt.evaluation.memcheck import run_fake_check
    from wrapopt.fingerprint import model_fingerprint
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric
    from wrapopt.models import zoo
    from wrapopt.plan.file import WrapPlan
    from wrapopt.search.baselines import baselines
    from wrapopt.spec import MeshSpec, PlanSpec, UnitSpec
    from wrapopt.trace.meta import trace_model

    entry = zoo.get_entry("llama-7b")
    model = entry.build("meta")
    graph = trace_model(model, entry.inputs(), loss_fn=entry.loss)
    mesh = MeshSpec(world_size=world_size, ranks_per_node=8, shard_size=world_size)
    base = baselines(graph, mesh)
    root = base["root-only"].units[-1]
    blocks = graph.blocks
    plans = [base["per-block"], base["root-only"], base["size-1e8"],
             PlanSpec(tuple(UnitSpec(blocks[i:i + 2]) for i in range(0, len(blocks), 2)) + (root,), mesh,
                      label="groups-of-2"),
             PlanSpec(tuple(UnitSpec((b,), True, True) for b in blocks) + (root,), mesh, label="per-block,ckpt"),
             PlanSpec(tuple(UnitSpec((b,), False) for b in blocks) + (root,), mesh, label="per-block,keep")]
    sim = Simulator(graph, analytical_fabric(world_size=world_size), analytical_compute())
    fp = model_fingerprint(model)
    jsons = [WrapPlan(spec=p, model=fp).to_json() for p in plans]
    t0 = time.perf_counter()
    tracked = run_fake_check("llama-7b", jsons, world_size=world_size)
    wall = time.perf_counter() - t0
    rows = []
    for p, tr in zip(plans, tracked):
        pred = sim.simulate(p).peak_bytes
        rows.append({"plan": p.label, "pred_peak_bytes": pred, "tracker_peak_bytes": tr["Total"],
                     "error": (pred - tr["Total"]) / tr["Total"], "tracker": tr})
    print(f"FSDPMemTracker check: {len(rows)} plans in {wall:.0f} s", file=sys.stderr)
    return rows


def scatter(all_runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.6))
    for run in all_runs:
        label = f"{run['model'].split(':')[1]} x{run['machine']['world_size']}"
        xs = [r["pred_step_s"] * 1e3 for r in run["rows"]]
        ys = [r["screen_step_s"] * 1e3 for r in run["rows"]]
        a1.scatter(xs, ys, label=label, s=18)
        a2.scatter([r["pred_peak_bytes"] / 2**20 for r in run["rows"]],
                   [r["meas_peak_bytes"] / 2**20 for r in run["rows"]], label=label, s=18)
    for ax, unit, title in ((a1, "ms", "step time"), (a2, "MiB", "peak memory per rank")):
        lo, hi = ax.get_xlim()
        lo2, hi2 = ax.get_ylim()
        lo, hi = min(lo, lo2), max(hi, hi2)
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
        ax.set_xlabel(f"predicted ({unit})")
        ax.set_ylabel(f"measured ({unit})")
        ax.set_title(title)
    a1.set_xscale("log")
    a1.set_yscale("log")
    a1.legend(fontsize=7)
    fig.suptitle("wrapopt simulator vs real FSDP2 steps (gloo, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(run: dict) -> dict:
    """Spearman over the screening round (every plan, one round); the fastest plans
    compared within the confirmation round (the contenders re-measured together,
    which holds the predicted fastest and the screening round's fastest)."""
    rows = run["rows"]
    pred_best = min(rows, key=lambda r: r["pred_step_s"])
    screen_best = min(rows, key=lambda r: r["screen_step_s"])
    pool = [r for r in rows if r["confirmed"]] or rows
    meas_best = min(pool, key=lambda r: r["meas_step_s"])
    # The same comparison round by round (See paired_ratio): 1.0 when the predicted fastest is the measured fastest.
    paired = ((1.0, 1.0, 1.0) if pred_best is meas_best
              else paired_ratio(pred_best["meas_times_s"], meas_best["meas_times_s"]))
    # The bench's resolution: the predicted fastest against a second copy of itself (See [Note: A/A copy]).
    noise = noise_floor(run)
    return {
        "model": run["model"], "world_size": run["machine"]["world_size"], "plans": len(rows),
        "spearman": spearman([r["pred_step_s"] for r in rows], [r["screen_step_s"] for r in rows]),
        "pred_fastest": pred_best["plan"], "meas_fastest": meas_best["plan"],
        "screen_ratio": pred_best["screen_step_s"] / screen_best["screen_step_s"],
        "pred_fastest_over_meas_fastest": pred_best["meas_step_s"] / meas_best["meas_step_s"],
        "paired_ratio": paired[0], "paired_ratio_ci90": [paired[1], paired[2]],
        "aa_ratio": noise[0] if noise else None, "aa_ratio_ci90": [noise[1], noise[2]] if noise else None,
        "confirmed": [r["plan"] for r in pool if r["confirmed"]],
        "worst_mem_error": max(abs(r["pred_peak_bytes"] - r["meas_peak_bytes"]) / r["meas_peak_bytes"] for r in rows),
        "median_spread": sorted(r["screen_spread"] for r in rows)[len(rows) // 2],
        "steal": run["machine"].get("steal"),
        "place_effect": place_effect(run),
        # Measured / predicted per phase, median over plans (See [Note: phases] in wrapopt/evaluation/evaluate.py).
        "phase_ratio": {k: statistics.median(_phase_ratios(r)[k] for r in rows)
                        for k in PHASES} if all("meas_phase_s" in r for r in rows) else None,
    }


def _phase_ratios(r: dict) -> dict[str, float]:
    """Measured / predicted time of each phase of one row."""
    return {k: r["meas_phase_s"][k] / r["pred_phase_s"][k] for k in PHASES}


def _phase_cell(r: dict) -> str:
    return ", ".join(f"{v:.2f}" for v in _phase_ratios(r).values()) if "meas_phase_s" in r else ""


def update_history(out_dir: str, entries: list[dict]) -> str:
    """Add runs to ``fidelity_history.json`` in ``out_dir`` (one entry per run, keyed
    by its date, so adding a run again replaces it) and write ``fidelity_history.md``:
    each case's verdict across runs, which is what says whether a miss is the
    model's or the machine's of the moment. Returns the markdown."""
    path = os.path.join(out_dir, "fidelity_history.json")
    runs: list[dict] = []
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)
        if not isinstance(runs, list) or not all(isinstance(r, dict) and "date" in r and "summaries" in r
                                                 for r in runs):
            raise SystemExit(f"{path}: expected a list of runs, each with 'date' and 'summaries'; fix or delete the "
                             f"file")
    by_date = {r["date"]: r for r in runs}
    by_date.update({e["date"]: e for e in entries})
    runs = sorted(by_date.values(), key=lambda r: r["date"])
    cases = sorted({(s["model"], s["world_size"]) for r in runs for s in r["summaries"]}, key=lambda c: (c[1], c[0]))
    lines = ["# Cost-model fidelity across runs", "",
             "Every run of `benchmarks/fidelity.py` adds its summary here; a column names its date (UTC), host, cores, "
             "backend and torch. A cell: the predicted fastest plan's measured step over the measured fastest's, as "
             "the median of per-round ratios in the confirmation round [90% bootstrap interval] (1.000: wrapopt "
             "predicted the fastest); then, for runs that had it, the A/A noise floor: the predicted fastest against a "
             "second copy of itself in the same round; then Spearman (predicted vs measured step, screening round); "
             "then, for runs that recorded it, the CPU steal over the case (time the hypervisor gave to other "
             "guests).", "",
             "| case "
             "| " + " "
                    "| ".join(f"{r['date'][:16].replace('T', ' ')} ({r.get('host', '?')}, {r.get('cores', '?')} cores, "
                                   f"{r.get('backend', '?')}, torch {r.get('torch', '?')})" for r in runs) + " |",
             "|---" * (len(runs) + 1) + "|"]
    for model, ws in cases:
        cells = []
        for r in runs:
            s = next((x for x in r["summaries"] if x["model"] == model and x["world_size"] == ws), None)
            if s is None:
                cells.append("not run")
                continue
            cell = fmt_ratio((s["paired_ratio"], *s["paired_ratio_ci90"]), ci_digits=2)
            if s.get("aa_ratio") is not None:
                cell += "; A/A " + fmt_ratio((s["aa_ratio"], *s["aa_ratio_ci90"]), ci_digits=2)
            cell += f"; ρ {s['spearman']:.2f}"
            cells.append(cell + (f"; steal {fmt_steal(s['steal'])}" if s.get("steal") is not None else ""))
        lines.append(f"| {model} ×{ws} | " + " | ".join(cells) + " |")
    lines += ["", "| run | cases | predicted fastest within 5% (paired median) | lowest Spearman | worst peak error "
              "| widest A/A interval | median spread | highest CPU steal |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ss = r["summaries"]
        aa = [x for x in ss if x.get("aa_ratio") is not None]
        widest = max(aa, key=lambda x: x["aa_ratio_ci90"][1] - x["aa_ratio_ci90"][0]) if aa else None
        lines.append(f"| {r['date'][:16].replace('T', ' ')} UTC | {len(ss)} | "
                     f"{sum(x['paired_ratio'] <= 1.05 for x in ss)} | {min(x['spearman'] for x in ss):.2f} | "
                     f"{max(x['worst_mem_error'] for x in ss):.1%} | "
                     + (f"[{widest['aa_ratio_ci90'][0]:.2f}, {widest['aa_ratio_ci90'][1]:.2f}] ({widest['model']} "
                        f"×{widest['world_size']})" if widest else "not measured")
                     + f" | {sorted(x['median_spread'] for x in ss)[len(ss) // 2]:.0%} | "
                     + fmt_steal(max((x["steal"] for x in ss if x.get("steal") is not None), default=None)) + " |")
    text = "\n".join(lines) + "\n"
    atomic_write_json(path, runs)
    atomic_write_text(os.path.join(out_dir, "fidelity_history.md"), text)
    return text


def _history_entry(date: str, wall_s: float | None, runs: list[dict], summaries: list[dict]) -> dict:
    m = runs[0]["machine"]
    return {"date": date, "wall_s": wall_s, "host": m["host"], "cores": m["cores"], "backend": m["backend"],
            "torch": m["torch"], "summaries": summaries}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(TRAINABLE))
    ap.add_argument("--world-sizes", default="2")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="results")
    ap.add_argument("--confirm", type=int, default=3, help="re-measure the K fastest of the screening round "
                    "and the predicted fastest in a second interleaved round (0: off)")
    ap.add_argument("--confirm-repeats", type=int, default=15)
    ap.add_argument("--cases", default="fp32,bf16,accum4",
                    help=f"training steps to measure, comma-separated: {', '.join(CASES)} (default fp32,bf16,accum4)")
    ap.add_argument("--tp", type=int, default=1, help="also run every plan at this tensor-parallel degree (2-D plans) "
                    "and let the search choose it (default 1: FSDP alone)")
    ap.add_argument("--name", default="fidelity", help="stem of the files written in --out (default fidelity: "
                    "fidelity.md, fidelity.json, fidelity_scatter.png)")
    ap.add_argument("--skip-tracker", action="store_true")
    ap.add_argument("--skip-speed", action="store_true", help="do not measure the simulator's speed")
    ap.add_argument("--render", metavar="JSON", help="measure nothing: write fidelity.md again from the fidelity.json "
                    "of an earlier run (pass that run's --world-sizes, --repeats, --confirm, --confirm-repeats)")
    ap.add_argument("--add-to-history", nargs="+", metavar="JSON", help="measure nothing: add the runs in these "
                    "fidelity.json files to fidelity_history.json/.md in --out")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.add_to_history:
        entries = []
        for path in args.add_to_history:
            with open(path) as f:
                data = json.load(f)
            entries.append(_history_entry(data["date"], data.get("wall_s"), data["runs"],
                                          [summarize(r) for r in data["runs"]]))
        print(update_history(args.out, entries))
        return 0
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        runs, tracker, speed, date = data["runs"], data["tracker"], data["simulator_speed"], data["date"]
        wall = data.get("wall_s")
    else:
        cases = args.cases.split(",")
        unknown = [c for c in cases if c not in CASES]
        if unknown:
            raise SystemExit(f"unknown --cases {', '.join(unknown)}; accepted: {', '.join(CASES)}")
        # The checks that need no ranks first: one that fails must not cost the measured runs.
        tracker = [] if args.skip_tracker else fake_tracker_check()
        speed = [] if args.skip_speed else simulator_speed()
        runs = []
        for ws in [int(w) for w in args.world_sizes.split(",")]:
            for case in cases:
                for model in args.models.split(","):
                    runs.append(evaluate(model, world_size=ws, plan_set="variants", repeats=args.repeats,
                                         memory_budget=None, confirm=args.confirm,
                                         confirm_repeats=args.confirm_repeats, train=CASES[case], tp=args.tp))
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        wall = time.perf_counter() - t0
    summaries = [summarize(r) for r in runs]
    m = runs[0]["machine"]
    lines = [
        "# Cost-model fidelity: predicted vs measured",
        "",
        f"Machine: {platform.node()}, {m['cores']} cores ({m['cpu']}), no GPU; backend {m['backend']}, one thread per "
        f"rank; torch {m['torch']}; {date}. Regenerate: `"
        + (f"python -m benchmarks.fidelity {shlex.join(sys.argv[1:])}` ({wall:.0f} "
           f"s)." if wall else  # as this run was called
           f"python -m benchmarks.fidelity --world-sizes {args.world_sizes} --repeats {args.repeats} --confirm "
           f"{args.confirm} --confirm-repeats {args.confirm_repeats} --cases {args.cases}` "
           "(this file written again from that run's fidelity.json with `--render`)."),
        "",
        "Each model: fabric and compute measured on the same ranks first; then every plan predicted by the simulator "
        f"and run for real, interleaved (one step of each plan per round, in an order that changes every round), 2 "
        f"warm-up rounds, median over {args.repeats} repeats of the slowest rank's step (the screening round; Spearman "
        "is computed on it). "
        + (f"Then a confirmation round: the {args.confirm} fastest plans of the screening round and the predicted "
           f"fastest, re-measured together, interleaved, {args.confirm_repeats} repeats; the predicted fastest is "
           f"compared with the measured fastest in that round, as a ratio of the two medians and as the median of the "
           "per-round ratios (the two steps of a round run moments apart, so the machine's drift between rounds "
           "cancels) with a 90% bootstrap interval; the screening round's ratio of medians is shown too. The same "
           "round also runs a second, separately built copy of the predicted fastest (an A/A test): its paired ratio "
           "to the original is the bench's noise floor, the smallest miss this run could tell from "
           "noise. " if args.confirm else "")
        + "Peak memory measured as live tensor bytes (CPU allocator events) per rank, max over ranks; a step of "
          "several micro-batches is tracked micro-batch by micro-batch. Cases: a model's name alone is fp32, one batch "
          "per step; [bf16] is bf16 parameters and compute with fp32 reduction (module times measured in bf16); "
          "[accumulation 4, sync last] is 4 micro-batches per step, synchronised on the last only. CPU steal: the "
          "share of the machine's CPU time the hypervisor gave to other guests while the case ran. Place in round: a "
          "step's time over its plan's median, median over the steps taken first in their round, and over those taken "
          "last (the order changes every round; 1.00 and 1.00 when the place does not matter).",
        "",
        "| model | ranks | plans | Spearman (step) | predicted fastest | measured fastest | meas(pred fastest) / meas "
        "fastest | same, paired by round (90% CI) | noise floor: A/A, paired (90% CI) | same, screening round | worst "
        "peak error | median spread | CPU steal | place in round: first, last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        aa = fmt_ratio((s["aa_ratio"], *s["aa_ratio_ci90"])) if s.get("aa_ratio") is not None else "not measured"
        lines.append(f"| {s['model']} | {s['world_size']} | {s['plans']} | {s['spearman']:.2f} | {s['pred_fastest']} | "
                     f"{s['meas_fastest']} | {s['pred_fastest_over_meas_fastest']:.3f} | "
                     f"{fmt_ratio((s['paired_ratio'], *s['paired_ratio_ci90']))} | {aa} | {s['screen_ratio']:.3f} | "
                     f"{s['worst_mem_error']:.1%} | {s['median_spread']:.0%} | "
                     + fmt_steal(s.get("steal")) + " | "
                     + (f"{s['place_effect'][0]:.2f}, "
                        f"{s['place_effect'][-1]:.2f}" if s.get("place_effect") else "not recorded")
                     + " |")
    if all(s.get("phase_ratio") for s in summaries):
        lines += ["", "## Where the predictions miss", "",
                  "Measured / predicted time of each phase of the step, median over the plans of a case (screening "
                  "round): forward with the loss; backward up to the last reduce-scatter (`backward()` waits for it); "
                  "the optimizer step. Per plan in the tables below.", "",
                  "| model | ranks | forward | backward | optimizer |", "|---|---|---|---|---|"]
        lines += [f"| {s['model']} | {s['world_size']} "
                  f"| " + " | ".join(f"{s['phase_ratio'][k]:.2f}" for k in PHASES) + " |"
                  for s in summaries]
    for run in runs:
        lines += ["", f"## {run['model']} on {run['machine']['world_size']} ranks", "",
                  "| plan | units | predicted step (ms) | measured step, screening (ms) | spread | confirmation round "
                  "(ms) | measured / predicted: forward, backward, optimizer | predicted peak | measured peak | error "
                  "|",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in run["rows"]:
            err = (r["pred_peak_bytes"] - r["meas_peak_bytes"]) / r["meas_peak_bytes"]
            conf = f"{r['meas_step_s'] * 1e3:.1f} ({r['meas_spread']:.0%})" if r["confirmed"] else ""
            lines.append(f"| {r['plan']} | {r['units']} | {r['pred_step_s'] * 1e3:.1f} | "
                         f"{r['screen_step_s'] * 1e3:.1f} | {r['screen_spread']:.0%} | {conf} | {_phase_cell(r)} | "
                         f"{fmt_bytes(r['pred_peak_bytes'])} | {fmt_bytes(r['meas_peak_bytes'])} | {err:+.1%} |")
    if tracker:
        lines += ["", "## Peak memory vs PyTorch's FSDPMemTracker: zoo:llama-7b, fake process group of 8 ranks", "",
                  "Fake tensors (no memory allocated), real `fully_shard` code, bf16, seq 4096, batch 1, AdamW; "
                  "the simulator with GPU semantics (analytical H100 compute profile).", "",
                  "| plan | predicted peak | FSDPMemTracker peak | error |", "|---|---|---|---|"]
        for r in tracker:
            lines.append(f"| {r['plan']} | {fmt_bytes(r['pred_peak_bytes'])} | {fmt_bytes(r['tracker_peak_bytes'])} | "
                         f"{r['error']:+.1%} |")
    rounds = len(next(iter(speed[0]["rounds"].values()))) if speed and "rounds" in speed[0] else 5  # older runs: 5
    lines += [] if not speed else ["", "## Simulator speed", "",
              "`Simulator.simulate` in this process (one core, one thread), llama-7b (32 blocks) on 64 ranks, "
              f"analytical fabric; best of {rounds} rounds (the machine is shared). `benchmarks/sim_speed.py` measures "
              f"the same alone, and the simulator's share of a search.", "",
              "| plans | units per plan | plan evaluations per second |", "|---|---|---|"]
    lines += [f"| {r['case']} | {r['units']:.0f} | {r['per_s']:,.0f} |" for r in speed]
    lines += ["", f"![predicted vs measured]({args.name}_scatter.png)", ""]
    os.makedirs(args.out, exist_ok=True)
    scatter(runs, os.path.join(args.out, f"{args.name}_scatter.png"))
    atomic_write_text(os.path.join(args.out, f"{args.name}.md"), "\n".join(lines))
    atomic_write_json(os.path.join(args.out, f"{args.name}.json"),
                      {"date": date, "wall_s": wall, "summaries": summaries, "runs": runs, "tracker": tracker,
                       "simulator_speed": speed})
    update_history(args.out, [_history_entry(date, wall, runs, summaries)])
    print("\n".join(lines[:12 + len(summaries)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
