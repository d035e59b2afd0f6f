"""Judging plans on measured steps: wrapopt's choice against the baselines and the measured optimum.

``judge(res)`` takes an ``evaluate`` result measured with several budgets and
returns, per budget, which plans fit by *measured* peak, the best fitting
baseline, the measured optimum among all fitting plans (after a confirmation
round: among the re-measured contenders, whose times come from one round),
and wrapopt's ratios to both. ``wrapopt bench`` (cli/bench.py) prints it; ``benchmarks/run_all.py`` publishes it.
"""

from __future__ import annotations

import statistics
from typing import Any

from wrapopt.fileio import fmt_bytes

__all__ = ["judge", "format_judgement", "BASELINES"]

BASELINES = ("per-block", "size-1e8", "every-leaf", "root-only", "no-shard")


def judge(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = res["rows"]
    out = []
    for b in res["budgets"]:
        fits = [r for r in rows if r["meas_peak_bytes"] <= b["bytes"]]
        mine = next(r for r in rows if b["name"] in r.get("chosen_for", []))
        # After a confirmation round only the contenders' second-round times are compared with
        # each other (See [Note: confirmation round] in evaluate.py): the others lost the screen.
        pool = [r for r in fits if r.get("confirmed")] or fits
        base = [r for r in pool if r["plan"] in BASELINES]
        best_base = min(base, key=lambda r: r["meas_step_s"]) if base else None
        optimum = min(pool, key=lambda r: r["meas_step_s"]) if pool else None
        # Run-to-run spread: median over plans of (max - min) / median across repeats.
        spread = statistics.median(r["meas_spread"] for r in rows)
        out.append({
            "budget": b["name"], "budget_bytes": b["bytes"], "why": b["why"], "wrapopt": mine["plan"],
            "wrapopt_fits": mine["meas_peak_bytes"] <= b["bytes"], "num_fit": len(fits),
            "best_baseline": best_base["plan"] if best_base else None,
            "vs_best_baseline": mine["meas_step_s"] / best_base["meas_step_s"] if best_base else None,
            "optimum": optimum["plan"] if optimum else None,
            "vs_optimum": mine["meas_step_s"] / optimum["meas_step_s"] if optimum else None,
            "median_spread": spread,
        })
    return out


def format_judgement(res: dict[str, Any], verdicts: list[dict[str, Any]], *, max_rows: int = 12) -> str:
    m = res["machine"]
    lines = [f"{res['model']} on {m['world_size']} {m['backend']} ranks, {len(res['rows'])} plans measured "
             f"(median of the slowest rank, interleaved); median run-to-run spread {verdicts[0]['median_spread']:.0%}"]
    for v in verdicts:
        budget = "none" if v["budget_bytes"] == float("inf") else fmt_bytes(v["budget_bytes"])
        lines += ["", f"budget {v['budget']} = {budget} ({v['why']}); {v['num_fit']} plans fit by measured peak"]
        fits = sorted((r for r in res["rows"] if r["meas_peak_bytes"] <= v["budget_bytes"]), key=lambda r: r["meas_step_s"])
        shown = fits[:max_rows]
        if not any(r["plan"] == v["wrapopt"] for r in shown):
            shown += [r for r in res["rows"] if r["plan"] == v["wrapopt"]]
        shown += [r for r in fits[max_rows:] if r["plan"] in BASELINES]
        for r in shown:
            mark = "*" if r["plan"] == v["wrapopt"] else " "
            lines.append(f"  {mark} {r['plan'][:34]:34} meas {r['meas_step_s'] * 1e3:8.2f} ms  pred {r['pred_step_s'] * 1e3:8.2f} ms"
                         f"  peak {fmt_bytes(r['meas_peak_bytes']):>10}")
        vb = f"{v['vs_best_baseline']:.3f} ({v['best_baseline']})" if v["vs_best_baseline"] else "n/a (no baseline fits)"
        vo = f"{v['vs_optimum']:.3f} ({v['optimum']})" if v["vs_optimum"] else "n/a"
        lines.append(f"  wrapopt / best fitting baseline = {vb};  wrapopt / measured optimum = {vo}"
                     + ("" if v["wrapopt_fits"] else "  [wrapopt's plan exceeded the budget when measured]"))
    return "\n".join(lines)
