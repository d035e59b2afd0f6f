"""``wrapopt demo`` / ``make demo``: the whole job, end to end, on this machine.

Two gloo ranks measure the local fabric and compute, trace a zoo model on
meta, search under a memory budget, apply the chosen plan and every baseline
with ``fully_shard``, run real training steps of all of them interleaved, and
print predicted against measured step time and peak memory.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from typing import Any

import torch

from wrapopt._io import atomic_write_json, atomic_write_text, fmt_bytes

__all__ = ["run_demo"]


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def _demo_worker(rank: int, world: int, model_name: str, repeats: int, budget: str | None) -> dict[str, Any] | None:
    import torch.distributed as dist

    from wrapopt import zoo
    from wrapopt.api import _broadcast_json, plan_model
    from wrapopt.bench import measure_plans
    from wrapopt.fabric import ComputeProfile
    from wrapopt.profile import measure_compute, measure_fabric
    from wrapopt.search import search_plan
    from wrapopt.cost import Simulator
    from wrapopt.trace import trace_model
    from wrapopt.types import MeshSpec
    from wrapopt._io import parse_bytes

    entry = zoo.get_entry(model_name)
    inputs = entry.inputs()
    t0 = time.perf_counter()
    _log(rank, f"[1/5] measuring the fabric on {world} gloo ranks ...")
    fabric = measure_fabric(sizes_bytes=tuple(4 ** k * 1024 for k in range(0, 7)), repeats=5, progress=False)
    _log(rank, f"[2/5] measuring compute (matmul, bandwidth, FSDP2 per-unit cost, {model_name} per-module times) ...")
    model = entry.build("cpu", seed=0)
    compute = measure_compute(model=model, example_inputs=inputs, loss_fn=entry.loss, repeats=5)
    compute = _broadcast_json(compute.to_json(), ComputeProfile.from_json)
    _log(rank, f"[3/5] tracing {model_name} on the meta device and searching ...")
    graph = trace_model(entry.build("meta"), inputs, loss_fn=entry.loss)
    mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)
    sim = Simulator(graph, fabric, compute)
    if budget is None:
        # A budget between the smallest and largest baseline peak, so the choice is not trivial.
        probe = search_plan(graph, sim, mesh)
        peaks = [s.estimate.peak_bytes for s in probe.baselines.values()]
        budget_bytes = (min(peaks) + max(peaks)) / 2
        budget_why = "midway between the smallest and largest predicted baseline peak"
    else:
        budget_bytes = float(parse_bytes(budget))
        budget_why = "given"
    wplan, result = plan_model(graph, model, mesh=mesh, fabric=fabric, compute=compute, memory_budget=budget_bytes)
    chosen = result.best.plan
    plans = [chosen] + [s.plan for s in result.baselines.values() if s.plan != chosen]
    labels = ["wrapopt:" + (chosen.label or "plan")] + [p.label for p in plans[1:]]
    plans = [p.__class__(units=p.units, mesh=p.mesh, forward_prefetch=p.forward_prefetch, label=l) for p, l in zip(plans, labels)]
    _log(rank, f"[4/5] running real steps of {len(plans)} plans, interleaved, {repeats} repeats after warm-up ...")
    measured = measure_plans(lambda: entry.build("cpu", seed=0), plans, inputs, entry.loss, repeats=repeats, warmup=2)
    _log(rank, f"[5/5] done in {time.perf_counter() - t0:.1f} s")
    if rank != 0:
        return None
    rows = []
    for p, m in zip(plans, measured):
        s = next(s for s in [result.best, *result.baselines.values()] if s.plan.units == p.units and s.plan.mesh == p.mesh)
        rows.append({
            "plan": p.label, "units": len(p.units), "chosen": p is plans[0], "fits": s.fits,
            "pred_step_s": s.estimate.step_s, "meas_step_s": m.step_s, "meas_spread": m.spread,
            "pred_peak_bytes": s.estimate.peak_bytes, "meas_peak_bytes": m.peak_bytes,
        })
    return {
        "rows": rows, "plan": wplan.to_json(), "fabric": fabric.to_json(), "compute": compute.to_json(),
        "budget_bytes": budget_bytes, "budget_why": budget_why,
        "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "backend": dist.get_backend(), "world_size": world, "threads_per_rank": 1},
    }


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else float("nan")


def format_demo(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"wrapopt demo: {res['model']} on {m['world_size']} {m['backend']} ranks ({m['cores']} cores, torch {m['torch']})",
        f"memory budget {fmt_bytes(res['budget_bytes'])} per rank ({res['budget_why']}); fabric measured here",
        "",
        f"{'':2}{'plan':32} {'units':>5} {'pred step':>10} {'meas step':>10} {'pred peak':>11} {'meas peak':>11} {'fits':>5}",
    ]
    lines.append("-" * len(lines[-1]))
    for r in res["rows"]:
        lines.append(
            f"{'*' if r['chosen'] else ' ':2}{r['plan'][:32]:32} {r['units']:5d} {r['pred_step_s'] * 1e3:8.2f}ms "
            f"{r['meas_step_s'] * 1e3:8.2f}ms {fmt_bytes(r['pred_peak_bytes']):>11} {fmt_bytes(r['meas_peak_bytes']):>11} "
            f"{'yes' if r['fits'] else 'no':>5}"
        )
    rows = res["rows"]
    rho = _spearman([r["pred_step_s"] for r in rows], [r["meas_step_s"] for r in rows])
    fit_rows = [r for r in rows if r["meas_peak_bytes"] <= res["budget_bytes"]]
    best_meas = min(fit_rows or rows, key=lambda r: r["meas_step_s"])
    chosen = rows[0]
    mem_err = max(abs(r["pred_peak_bytes"] - r["meas_peak_bytes"]) / r["meas_peak_bytes"] for r in rows)
    lines += [
        "* = wrapopt's choice. Step times: median of the slowest rank over repeats, plans interleaved.",
        f"chosen / fastest measured plan within the budget ({best_meas['plan']}): {chosen['meas_step_s'] / best_meas['meas_step_s']:.2f}",
        f"Spearman(pred, meas step) = {rho:.2f}; worst peak-memory error = {mem_err:.0%}",
    ]
    return "\n".join(lines)


def run_demo(*, out_dir: str = "results/demo", model: str = "gpt-tiny", world_size: int = 2, repeats: int = 5,
             memory_budget: str | None = None, timeout_s: float = 600.0) -> int:
    from wrapopt.launch import spawn

    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    res = spawn(_demo_worker, world_size=world_size, args=(model, repeats, memory_budget), timeout_s=timeout_s)[0]
    res["model"] = f"zoo:{model}"
    res["wall_s"] = time.perf_counter() - t0
    res["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    text = format_demo(res)
    atomic_write_json(os.path.join(out_dir, "plan.json"), res["plan"])
    atomic_write_json(os.path.join(out_dir, "fabric.json"), res["fabric"])
    atomic_write_json(os.path.join(out_dir, "report.json"), {k: v for k, v in res.items() if k not in ("plan", "fabric")})
    atomic_write_text(os.path.join(out_dir, "report.md"), f"# wrapopt demo ({res['date']})\n\n```\n{text}\n```\n\n"
                      f"Wall time {res['wall_s']:.0f} s. Regenerate with `make demo`.\n")
    print(text)
    print(f"\nwrote {out_dir}/plan.json, report.md, report.json, fabric.json  ({res['wall_s']:.0f} s)")
    return 0
