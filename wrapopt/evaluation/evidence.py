"""Judging plans on measured steps: wrapopt's choice against the baselines and the measured optimum.

``judge(res)`` takes an ``evaluate`` result measured with several budgets and
returns, per budget, which plans fit by *measured* peak, the best fitting
baseline, the measured optimum among all fitting plans (after a confirmation
round: among the re-measured contenders, whose times come from one round),
and wrapopt's ratios to both. ``wrapopt bench`` (cli/bench.py) prints it; ``benchmarks/run_all.py`` publishes it.

[Note: diagnosis] Where wrapopt's plan is measurably slower than the best fitting
contender (its ratio further above 1.00 than the A/A interval reaches from 1.00 on
either side, or above 1.00 when no A/A copy ran), ``diagnose`` says why the search passed the contender over, from the
figures the row already has:
(c) ``not searched``: the search never scored the contender (not in its space: the
    row's ``scored_for`` lacks the budget). The simulator's view of it is added, since
    putting it in the space helps only if the simulator would then prefer it;
(a) ``memory``: its predicted peak is over the budget while its measured peak is
    under: memory predicted too high excluded it;
(b) ``time``: it was predicted to fit but predicted no faster than wrapopt's plan:
    the simulator ranked it slower;
``over budget``: wrapopt's own plan did not fit when measured (memory predicted too
low), reported whether or not it was slower: its ratio compares it with plans that fit;
``other``: scored, predicted to fit and predicted faster, yet not chosen (a search bug).
"""

from __future__ import annotations

import statistics
from typing import Any

from wrapopt.fileio import fmt_bytes

__all__ = ["judge", "diagnose", "fmt_diagnosis", "format_judgement", "BASELINES", "CAUSES"]

BASELINES = ("per-block", "per-block,ckpt", "size-1e8", "every-leaf", "root-only", "no-shard")

# What each diagnosis means, for the reports. See [Note: diagnosis].
CAUSES = {
    "memory": "(a) memory predicted too high: the contender's predicted peak is over the budget, "
              "its measured peak under",
    "time": "(b) time mispredicted: the simulator ranked the contender no faster than wrapopt's plan",
    "not searched": "(c) not in the search space: the search never scored the contender",
    "over budget": "wrapopt's plan exceeded the budget when measured (memory predicted too low)",
    "other": "scored, predicted to fit and faster, yet not chosen",
}


def diagnose(mine: dict[str, Any], contender: dict[str, Any], *, budget: str, budget_bytes: float,
             noise: tuple[float, float, float] | None = None) -> dict[str, Any] | None:
    """Why wrapopt's row ``mine`` lost to the fitting row ``contender`` under ``budget``; None when
    it did not lose measurably (ratio <= 1.00, or inside the A/A interval ``noise``) and fits. Rows are
    ``evaluate``'s (predicted and measured step and peak, ``scored_for``). See [Note: diagnosis]."""
    ratio = mine["meas_step_s"] / contender["meas_step_s"]
    over = mine["meas_peak_bytes"] > budget_bytes  # a failure whatever the times say
    # The A/A interval's farthest reach from 1.00 is how far two copies of one plan can differ.
    reach = max(noise[2] - 1.0, 1.0 - noise[1], 0.0) if noise else 0.0
    if not over and (ratio <= 1.0 + reach or mine is contender):
        return None
    pred_over = contender["pred_peak_bytes"] > budget_bytes
    pred_slower = contender["pred_step_s"] >= mine["pred_step_s"]
    view = ("predicted peak over budget" if pred_over else
            "predicted slower than wrapopt's plan" if pred_slower else "predicted to fit and faster")
    if over:
        cause = "over budget"
    elif budget not in contender.get("scored_for", ()):
        cause = "not searched"
    elif pred_over:
        cause = "memory"
    elif pred_slower:
        cause = "time"
    else:
        cause = "other"
    return {"cause": cause, "contender": contender["plan"], "ratio": ratio, "simulator": view,
            "pred_ratio": mine["pred_step_s"] / contender["pred_step_s"]}


def judge(res: dict[str, Any], noise: tuple[float, float, float] | None = None) -> list[dict[str, Any]]:
    """Per budget, the verdict on wrapopt's plan; ``noise`` is the run's A/A interval
    (``evaluate.noise_floor``), used to tell a measurable loss from noise in ``diagnosis``."""
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
            "diagnosis": (diagnose(mine, optimum, budget=b["name"], budget_bytes=b["bytes"], noise=noise)
                          if optimum else None),
        })
    return out


def format_judgement(res: dict[str, Any], verdicts: list[dict[str, Any]], *, max_rows: int = 12) -> str:
    m = res["machine"]
    lines = [f"{res['model']} on {m['world_size']} {m['backend']} ranks, {len(res['rows'])} plans measured "
             f"(median of the slowest rank, interleaved); median run-to-run spread {verdicts[0]['median_spread']:.0%}"]
    for v in verdicts:
        budget = "none" if v["budget_bytes"] == float("inf") else fmt_bytes(v["budget_bytes"])
        lines += ["", f"budget {v['budget']} = {budget} ({v['why']}); {v['num_fit']} plans fit by measured peak"]
        fits = sorted((r for r in res["rows"] if r["meas_peak_bytes"] <= v["budget_bytes"]),
                      key=lambda r: r["meas_step_s"])
        shown = fits[:max_rows]
        if not any(r["plan"] == v["wrapopt"] for r in shown):
            shown += [r for r in res["rows"] if r["plan"] == v["wrapopt"]]
        shown += [r for r in fits[max_rows:] if r["plan"] in BASELINES]
        for r in shown:
            mark = "*" if r["plan"] == v["wrapopt"] else " "
            lines.append(f"  {mark} {r['plan'][:34]:34} meas {r['meas_step_s'] * 1e3:8.2f} ms  "
                         f"pred {r['pred_step_s'] * 1e3:8.2f} ms  peak {fmt_bytes(r['meas_peak_bytes']):>10}")
        vb = (f"{v['vs_best_baseline']:.3f} ({v['best_baseline']})" if v["vs_best_baseline"]
              else "n/a (no baseline fits)")
        vo = f"{v['vs_optimum']:.3f} ({v['optimum']})" if v["vs_optimum"] else "n/a"
        lines.append(f"  wrapopt / best fitting baseline = {vb};  wrapopt / measured optimum = {vo}"
                     + ("" if v["wrapopt_fits"] else "  [wrapopt's plan exceeded the budget when measured]"))
        if v.get("diagnosis"):
            lines.append(f"  diagnosis: {fmt_diagnosis(v['diagnosis'])}")
    return "\n".join(lines)


def fmt_diagnosis(d: dict[str, Any] | None) -> str:
    """One cell of the bench report: the cause and what the simulator thought of the contender."""
    if d is None:
        return "-"
    return (f"{d['cause']}: wrapopt / {d['contender']} = {d['ratio']:.3f} measured, {d['pred_ratio']:.3f} predicted; "
            f"the simulator: {d['simulator']}")
