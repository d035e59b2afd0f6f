"""``wrapopt demo`` / ``make demo``: the whole job, end to end, on this machine.

Two gloo ranks measure the local fabric and compute, trace a zoo model on
meta, search under a memory budget, apply the chosen plan and every baseline
with ``fully_shard``, run real training steps of all of them interleaved, and
print predicted against measured step time and peak memory. It draws the
chosen plan's predicted step beside the per-block baseline's
(``timeline.png``) and every scored plan's predicted time against memory with
the measured points (``pareto.png``), and links both from ``report.md``.

Only wrapopt's own lines reach the terminal; the ranks' own output (library
warnings, profiler lines) goes to ``<out>/logs/`` unless ``verbose``.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

from wrapopt.choices import DEMO_OUT_DIR
from wrapopt.errors import WrapoptError
from wrapopt.evaluation.evaluate import evaluate
from wrapopt.evaluation.stats import spearman
from wrapopt.evaluation.pictures import PICTURES, write_pictures
from wrapopt.fileio import atomic_write_json, atomic_write_text, fmt_bytes
from wrapopt.train import TrainConfig
from wrapopt.launch import logs_line

__all__ = ["run_demo", "format_rows", "DEMO_OUT_DIR"]

# Where ``make demo`` and ``wrapopt demo`` write: a folder .gitignore lists, so a run leaves
# the tree clean. ``results/demo/`` is the recorded run, committed (results/README.md).
def format_rows(res: dict[str, Any]) -> str:
    """The predicted-vs-measured table of an ``evaluate`` result, with its summary lines."""
    m = res["machine"]
    budget = res["budget_bytes"]
    lines = [
        f"{res['model']} on {m['world_size']} {m['backend']} ranks ({m['cores']} cores, {m['threads_per_rank']} thread "
        f"per rank, torch {m['torch']}); fabric and compute measured here",
        f"memory budget {fmt_bytes(budget) if budget != float('inf') else 'none'} per rank ({res['budget_why']})",
        "",
        f"{'':2}{'plan':30} {'units':>5} {'pred step':>10} {'meas step':>10} {'spread':>6} {'pred peak':>11} "
        f"{'meas peak':>11} {'fits':>4}",
    ]
    lines.append("-" * len(lines[-1]))
    rows = res["rows"]
    for r in rows:
        lines.append(
            f"{'*' if r['chosen'] else ' ':2}{r['plan'][:30]:30} {r['units']:5d} {r['pred_step_s'] * 1e3:8.2f}ms "
            f"{r['meas_step_s'] * 1e3:8.2f}ms {r['meas_spread']:5.0%} {fmt_bytes(r['pred_peak_bytes']):>11} "
            f"{fmt_bytes(r['meas_peak_bytes']):>11} {'yes' if r['fits'] else 'no':>4}"
        )
    fit = [r for r in rows if r["fits"]] or rows
    best = min(fit, key=lambda r: r["meas_step_s"])
    rho = spearman([r["pred_step_s"] for r in rows], [r["meas_step_s"] for r in rows])
    mem_err = max(abs(r["pred_peak_bytes"] - r["meas_peak_bytes"]) / r["meas_peak_bytes"] for r in rows)
    lines += [
        "* = wrapopt's choice. Step: median over repeats of the slowest rank, plans interleaved; "
        "spread = (max-min)/median.",
        f"wrapopt's plan / fastest measured plan that fits the budget ({best['plan']}): "
        f"{rows[0]['meas_step_s'] / best['meas_step_s']:.2f}",
        f"Spearman(predicted, measured step) = {rho:.2f} over {len(rows)} plans; "
        f"worst peak-memory error = {mem_err:.0%}",
    ]
    return "\n".join(lines)


def _pictures(out_dir: str, res: dict[str, Any]) -> tuple[list[str], str]:
    """Draw the two pictures; returns (the files written, the report's lines about them)."""
    m = res["machine"]
    title = f"{res['model']} on {m['world_size']} {m['backend']} ranks, fabric and compute measured here"
    try:
        write_pictures(out_dir, res["pictures"], measured=res["rows"], title=title)
    except WrapoptError as e:  # matplotlib missing: the demo's numbers still stand
        return [], f"No pictures: {e}.\n"
    return list(PICTURES), (
        "## Where the time goes\n\nThe chosen plan's predicted step above the per-block baseline's: compute and "
        "communication lanes, memory held while computing.\n\n![predicted step timelines](timeline.png)\n\n"
        "## Time against memory\n\nEvery plan the search scored (predicted), the time-memory front of those that "
        "fit, the budget, and, hollow, where the plans run here were measured.\n\n![predicted and measured time "
        "against memory](pareto.png)\n")


def run_demo(*, out_dir: str = DEMO_OUT_DIR, model: str = "gpt-tiny", world_size: int = 2, repeats: int = 11,
             memory_budget: str | None = None, train: TrainConfig | None = None, verbose: bool = False) -> int:
    """``train``: run every plan in that mixed precision and accumulation (default fp32, one batch);
    ``verbose``: the ranks' own output on the terminal instead of in the log folder."""
    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    log_dir = None if verbose else os.path.join(out_dir, "logs")  # See [Note: quiet ranks] in launch.py
    res = evaluate(model, world_size=world_size, plan_set="baselines", repeats=repeats,
                   memory_budget=memory_budget or "midway", train=train, log_dir=log_dir)
    res["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    text = format_rows(res)
    atomic_write_json(os.path.join(out_dir, "plan.json"), res["plan_json"])
    atomic_write_json(os.path.join(out_dir, "fabric.json"), res["fabric"])
    atomic_write_json(os.path.join(out_dir, "report.json"),
                      {k: v for k, v in res.items() if k not in ("plan_json", "fabric")})
    pictures, section = _pictures(out_dir, res)
    wall = time.perf_counter() - t0
    atomic_write_text(os.path.join(out_dir, "report.md"), f"# wrapopt demo ({res['date']})\n\n```\n{text}\n```\n\n"
                      f"{section}\nWall time {wall:.0f} s. Regenerate with "
                      f"`python -m wrapopt.cli demo --out {out_dir}`.\n")
    print(f"wrapopt demo\n{text}")
    print(f"\nwrote {out_dir}/plan.json, report.md, report.json, fabric.json{''.join(', ' + p for p in pictures)}  "
          f"({wall:.0f} s)")
    if log_dir:
        print(logs_line(log_dir))
    return 0
