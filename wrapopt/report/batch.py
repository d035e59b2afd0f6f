"""The micro-batch x accumulation splits of a fixed global batch, as text and JSON: the chosen
split beside the others' best predicted steps (See [Note: global batch search] in
search/batch.py). The rows come from the search; nothing here simulates."""

from __future__ import annotations

from typing import Any, Sequence

from wrapopt.fileio import fmt_bytes
from wrapopt.search.driver import SearchResult

__all__ = ["batch_lines", "format_batch", "batch_json"]


def _head(split: Any) -> str:
    axes = "".join(f", {name}{getattr(split, f'{name}_size', 1)}" for name in ("tp", "cp", "ep")
                   if getattr(split, f"{name}_size", 1) > 1)  # a pipeline's split has no cp or ep
    return f"micro-batch {split.micro_batch} x {split.accumulation} accumulation ({split.dp_size} dp ranks{axes})"


def batch_lines(rows: Sequence[Any], chosen: Any) -> list[str]:
    """One line per split (``search.batch.BatchRow``): micro-batch x accumulation, its best
    predicted step and peak, how far it was searched; the chosen one marked."""
    out = []
    for r in rows:
        if r.best is None:
            out.append(f"  {_head(r.split)}: {r.searched}")
            continue
        e = r.best.estimate
        sync = f"sync {e.accumulation_sync:<5} " if e.accumulation_sync else ""  # under accumulation
        out.append(f"{'*' if r.split == chosen else ' '} {_head(r.split):52} {e.step_s * 1e3:10.2f}ms "
                   f"{fmt_bytes(e.peak_bytes):>11} {'fits' if r.best.fits else 'does not fit':<12} {sync}{r.searched}")
    return out


def _chosen(result: SearchResult) -> Any:
    return next((r.split for r in result.batch_rows if r.chosen), None)


def format_batch(result: SearchResult) -> str:
    """The splits of the global batch, each with its best plan's step (the whole step: every
    micro-batch and the optimizer) and peak; * = wrapopt's choice."""
    chosen = _chosen(result)
    total = result.batch_rows[0].split.global_batch if result.batch_rows else "?"
    lines = [f"global batch {total} = micro-batch x accumulation x data-parallel ranks (micro-batch: sequences "
             "per data-parallel rank, TorchTitan's local_batch_size; predicted step for the whole global batch, best "
             "plan of each split):"]
    lines += batch_lines(result.batch_rows, chosen)
    modes = {r.best.estimate.accumulation_sync for r in result.batch_rows if r.best is not None} - {None}
    if len(modes) > 1:  # the rows' steps and peaks are not at one sync mode: say which
        lines.append("  ! the splits differ in gradient sync (every: reduce-scatter after each micro-batch; last: "
                     "no-sync until the last); --sync every or --sync last compares them at one")
    lines.append(("  * = chosen" if chosen is not None else "  none chosen: a pipeline plan is faster (below)")
                 + "; screen: searched without the study on FSDP over the data-parallel ranks only; "
                 "whole search: every shard group and the study")
    return "\n".join(lines)


def batch_json(result: SearchResult) -> list[dict[str, Any]] | None:
    """Every split as JSON; None when the global batch was not fixed."""
    if not result.batch_rows:
        return None
    chosen = _chosen(result)
    return [{"tp_size": r.split.tp_size, "micro_batch": r.split.micro_batch, "accumulation": r.split.accumulation,
             "dp_size": r.split.dp_size, "cp_size": r.split.cp_size, "ep_size": r.split.ep_size,
             "searched": r.searched,
             "chosen": r.split == chosen,
             **({} if r.best is None else {"label": r.best.plan.label, "step_s": r.best.estimate.step_s,
                                          "sync": r.best.estimate.accumulation_sync,
                                          "peak_bytes": r.best.estimate.peak_bytes, "fits": r.best.fits})}
            for r in result.batch_rows]
