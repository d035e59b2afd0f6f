"""What ``wrapopt search`` says about the training step of its choice: the peak's
breakdown and, under gradient accumulation, both sync modes side by side."""

from __future__ import annotations

from typing import Any

from wrapopt.cost import Simulator
from wrapopt.fileio import fmt_bytes
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.report.estimate import format_breakdown
from wrapopt.search.driver import SearchResult
from wrapopt.spec import SYNC_MODES, CostEstimate, ModelGraph
from wrapopt.train import TrainConfig

__all__ = ["format_sync", "sync_json"]

_MODE = {"last": "last (no-sync until the last micro-batch)", "every": "every micro-batch"}


def _both(result: SearchResult, graph: ModelGraph, fabric: FabricProfile, compute: ComputeProfile, train: TrainConfig,
          budget: float | None) -> dict[str, CostEstimate]:
    plan = result.best.plan
    return {m: Simulator(graph, fabric, compute, train.with_sync(m).sim_options(memory_budget=budget)).simulate(plan)
            for m in SYNC_MODES}


def format_sync(result: SearchResult, graph: ModelGraph, fabric: FabricProfile, compute: ComputeProfile,
                train: TrainConfig, budget: float | None) -> str:
    best = result.best.estimate
    lines = [f"peak memory of wrapopt's choice: {fmt_bytes(best.peak_bytes)} per rank"]
    lines += format_breakdown(best)
    if train.grad_accumulation > 1:
        limit = budget if budget is not None else float("inf")
        lines.append(f"gradient sync over {train.grad_accumulation} micro-batches, wrapopt's choice scored both ways:")
        for m, e in _both(result, graph, fabric, compute, train, budget).items():
            mark = "*" if m == best.accumulation_sync else " "
            lines.append(f" {mark} {_MODE[m]:42} {e.step_s * 1e3:10.2f}ms {fmt_bytes(e.peak_bytes):>11} "
                         f"{'fits' if e.peak_bytes <= limit else 'does NOT fit'}")
            if m == "last":
                held = dict(e.peak_breakdown).get("accumulated_grads", 0)
                lines.append(f"    holds {fmt_bytes(held)} of unsharded gradients across micro-batches")
        lines.append("  * = chosen: " + ("as asked (--sync)" if train.accumulation_sync else "the faster that fits"))
    return "\n".join(lines)


def sync_json(result: SearchResult, graph: ModelGraph, fabric: FabricProfile, compute: ComputeProfile,
              train: TrainConfig, budget: float | None) -> dict[str, Any] | None:
    if train.grad_accumulation == 1:
        return None
    out: dict[str, Any] = {"chosen": result.best.estimate.accumulation_sync}
    for m, e in _both(result, graph, fabric, compute, train, budget).items():
        out[m] = {"step_s": e.step_s, "peak_bytes": e.peak_bytes, "peak_breakdown": dict(e.peak_breakdown)}
    return out
