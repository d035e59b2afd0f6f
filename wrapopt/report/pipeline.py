"""The 3-D search in the report: the best plan per pipeline degree, its stages and schedule
(See [Note: pipeline search] in wrapopt/search/pipeline.py)."""

from __future__ import annotations

from typing import Any

from wrapopt.fileio import fmt_bytes
from wrapopt.search.driver import Scored, SearchResult
from wrapopt.spec import PlanSpec

__all__ = ["format_pipeline", "pipeline_json", "describe_stages"]


def describe_stages(plan: PlanSpec, blocks: tuple[str, ...] = ()) -> str:
    """"4 stages (2 per rank), Interleaved1F1B, 16 micro-batches; blocks per stage 10/11/11/10";
    "no pipeline" for a plan without one."""
    pipe = plan.pipeline
    if pipe is None:
        return "no pipeline"
    per_rank = pipe.virtual_stages(plan.mesh.pp_size)
    counts = []
    for mods in pipe.stages:
        n = sum(1 for m in mods if m.rsplit(".", 1)[-1].isdigit()) if not blocks else sum(m in blocks for m in mods)
        counts.append(str(n))
    return (f"{len(pipe.stages)} stages" + (f" ({per_rank} per rank)" if per_rank > 1 else "")
            + f", {pipe.schedule}, {pipe.microbatches} micro-batches; blocks per stage {'/'.join(counts)}")


def _mesh(plan: PlanSpec) -> str:
    m = plan.mesh
    cp = f", cp {m.cp_size}" if m.cp_size > 1 else ""  # the cp ranks are in the shard group (dp_shard x cp)
    ep = f", ep {m.ep_size}" if m.ep_size > 1 else ""  # the experts split over ep of a stage's dp ranks
    return f"pp{m.pp_size} x dp{m.dp_size} (shard {m.shard_size}{cp}{ep}) x tp{m.tp_size}"


def format_pipeline(result: SearchResult) -> str:
    """The rows of ``SearchResult.pp_rows``: per pipeline degree its best plan, and what became of every degree."""
    # at a local batch a cp row's step runs 1/cp of the tokens per GPU: See [Note: cp in a pipeline] in search/shapes.py
    head = ("pipeline degrees (compared per token: a cp row's step runs 1/cp of the tokens per GPU):"
            if result.pp_per_token else "pipeline degrees (every row at the same global batch):")
    lines = ["", head, f"  {'row':48} {'mesh':30} {'step':>10} {'peak':>11} {'fits':>4}"]
    for label, s in result.pp_rows:
        e = s.estimate
        lines.append(f"  {label[:48]:48} {_mesh(s.plan):30} {e.step_s * 1e3:8.1f}ms {fmt_bytes(e.peak_bytes):>11} "
                     f"{'yes' if s.fits else 'NO':>4}")
        lines.append(f"      {s.plan.label}: {describe_stages(s.plan)}")
    if result.pp_tried:
        lines.append("  degrees: " + "; ".join(f"pp{d}: {what}" for d, what in result.pp_tried))
    return "\n".join(lines)


def _row(label: str, s: Scored) -> dict[str, Any]:
    pipe = s.plan.pipeline
    return {"row": label, "label": s.plan.label, "pp_size": s.plan.mesh.pp_size, "tp_size": s.plan.mesh.tp_size,
            "cp_size": s.plan.mesh.cp_size, "ep_size": s.plan.mesh.ep_size,
            "shard_size": s.plan.mesh.shard_size, "step_s": s.estimate.step_s, "peak_bytes": s.estimate.peak_bytes,
            "fits": s.fits, "schedule": pipe.schedule if pipe else None,
            "microbatches": pipe.microbatches if pipe else None,
            "stages": describe_stages(s.plan)}


def pipeline_json(result: SearchResult) -> dict[str, Any] | None:
    """The rows as JSON (None without a pipeline search)."""
    if not result.pp_rows and not result.pp_tried:
        return None
    return {"rows": [_row(label, s) for label, s in result.pp_rows],
            "tried": [{"pp": d, "outcome": what} for d, what in result.pp_tried]}
