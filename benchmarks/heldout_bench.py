"""Issue 51: the bench row of the held-out-style family (zoo:mha-tied: a GPT of user blocks around
``nn.MultiheadAttention``, head tied to the embedding), written to results/heldout_mha.md and .json.

The same loop as ``make bench``'s wider bench set (``evaluate``: fabric and compute measured on the
ranks, wrapopt's plan per budget, the ``uniform`` plan set, interleaved steps, a confirmation round
with an A/A copy), with a longer timeout for a shared machine:

    python -m benchmarks.heldout_bench [--budgets tight,midway,loose] [--repeats 5] [--timeout 3000]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile

from wrapopt.evaluation.evaluate import evaluate
from wrapopt.evaluation.evidence import fmt_diagnosis, judge
from wrapopt.evaluation.stats import fmt_ratio, fmt_steal, noise_floor, spearman
from wrapopt.fileio import atomic_write_json, atomic_write_text

MODEL = "mha-tied"
HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "results")


def table(res: dict, verdicts: list[dict], command: str) -> str:
    m = res["machine"]
    aa = noise_floor(res)
    rho = spearman([r["pred_step_s"] for r in res["rows"]], [r["screen_step_s"] for r in res["rows"]])
    lines = [
        "# Held-out-style family: zoo:mha-tied (issue 51)", "",
        f"Measured on {m['host']}: {m['cores']} CPU cores ({m['cpu']}), backend {m['backend']}, world size "
        f"{m['world_size']}, {m['threads_per_rank']} thread per rank, torch {m['torch']}; "
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; the case took "
        f"{res['wall_s']:.0f} s; CPU steal {fmt_steal(m.get('steal'))}.", "",
        f"Reproduce: `{command}`", "",
        "| budget | plans fit | wrapopt's plan | / best fitting baseline | / measured optimum (plan) | "
        "A/A (90% CI) | Spearman pred vs meas | diagnosis |",
        "|---|---|---|---|---|---|---|---|",
    ]
    floor = fmt_ratio(aa) if aa else "not measured"
    for v in verdicts:
        vb = f"{v['vs_best_baseline']:.3f} ({v['best_baseline']})" if v["vs_best_baseline"] else "no baseline fits"
        vo = f"{v['vs_optimum']:.3f} ({v['optimum']})" if v["vs_optimum"] else "n/a"
        lines.append(f"| {v['budget']} | {v['num_fit']} | {v['wrapopt']} | {vb} | {vo} | {floor} | {rho:.2f} | "
                     f"{fmt_diagnosis(v.get('diagnosis'))} |")
    lines += ["", "| plan | units | measured step (ms) | predicted step (ms) | measured peak (MiB) | "
              "predicted peak (MiB) | confirmed |", "|---|---|---|---|---|---|---|"]
    for r in sorted(res["rows"], key=lambda r: r["meas_step_s"]):
        lines.append(f"| {r['plan']} | {r['units']} | {r['meas_step_s'] * 1e3:.1f} | {r['pred_step_s'] * 1e3:.1f} | "
                     f"{r['meas_peak_bytes'] / 2**20:.2f} | {r['pred_peak_bytes'] / 2**20:.2f} | "
                     f"{'yes' if r['confirmed'] else ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="tight,midway,loose")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--confirm", type=int, default=4)
    ap.add_argument("--confirm-repeats", type=int, default=15)
    ap.add_argument("--timeout", type=float, default=3000.0)
    ap.add_argument("--name", default="heldout_mha", help="results/NAME.md and .json")
    args = ap.parse_args(argv)
    res = evaluate(MODEL, world_size=2, plan_set="uniform", repeats=args.repeats, budgets=args.budgets.split(","),
                   confirm=args.confirm, confirm_repeats=args.confirm_repeats, timeout_s=args.timeout,
                   log_dir=os.path.join(tempfile.gettempdir(), "wrapopt-heldout", "logs"))
    verdicts = judge(res, noise_floor(res))
    command = "python -m benchmarks.heldout_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    atomic_write_json(os.path.join(RESULTS, f"{args.name}.json"), {"result": res, "verdicts": verdicts,
                                                                    "python": platform.python_version()})
    text = table(res, verdicts, command.strip())
    atomic_write_text(os.path.join(RESULTS, f"{args.name}.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
