"""The user's current configuration beside the search's, as text and JSON: the whole gain and
each differing choice's gain alone (See [Note: the current configuration] in search/current.py).
Nothing here simulates."""

from __future__ import annotations

from typing import Any

from wrapopt.fileio import fmt_bytes

__all__ = ["format_current", "current_json"]


def _line(name: str, c: Any, ref: Any) -> str:
    gain = c.sequences_per_s_per_rank / ref.sequences_per_s_per_rank
    sync = c.estimate.accumulation_sync  # under accumulation: every row states its mode
    return (f"  {name:<34} {c.estimate.step_s * 1e3:10.1f}ms  x{gain:5.3f}  peak {fmt_bytes(c.estimate.peak_bytes):>10}"
            f" ({_signed(c.estimate.peak_bytes - ref.estimate.peak_bytes)})" + (f"  sync {sync}" if sync else ""))


def _signed(delta: float) -> str:
    return ("+" if delta >= 0 else "-") + fmt_bytes(abs(delta))


def _split(c: Any) -> str:
    """How ``c`` runs a step: its micro-batch and accumulation, or a pipeline's micro-batches."""
    m = c.plan.mesh
    if c.plan.pipeline is None:
        return f"micro-batch {c.micro_batch} x {c.accumulation} accumulation"
    axes = "".join(f", {n} {d}" for n, d in (("tp", m.tp_size), ("cp", m.cp_size), ("ep", m.ep_size)) if d > 1)
    return (f"{c.accumulation} micro-batches of {c.micro_batch} on each of {m.batch_size} pipelines "
            f"(pp {m.pp_size}{axes})")


def format_current(cmp: Any, budget: float | None = None) -> str:
    """The current configuration, the search's, and each choice that differs, applied alone
    to the current one: step (the whole global batch), tokens/s/GPU against the current, peak."""
    cur, best = cmp.current, cmp.chosen
    fits = "" if budget is None or cur.estimate.peak_bytes <= budget else " (over the memory budget)"
    name = f"wrapopt ({best.plan.label or 'searched'}, mb {best.micro_batch})"[:34]
    out = [f"Current configuration ({cmp.current_text}){fits}: {_split(cur)} on {cur.plan.mesh.world_size} ranks; "
           f"wrapopt's is x{cmp.speedup:.3f} tokens/s/GPU.",
           "  configuration                      step (whole batch)  tokens/s/GPU  peak (vs current)",
           _line("current", cur, cur), _line(name, best, cur)]
    if cmp.gains:
        out.append("  each choice that differs, alone on the current configuration:")
    for g in cmp.gains:
        name = f"{g.dimension}: {g.current} -> {g.chosen}"
        if g.alone is None:
            out.append(f"  {name:<34} not scored alone: {g.why_not}")
        else:
            over = "" if budget is None or g.alone.estimate.peak_bytes <= budget else "  (over the budget alone)"
            out.append(_line(name, g.alone, cur) + over)
    if len([g for g in cmp.gains if g.alone is not None]) > 1:
        out.append("  (the choices interact: their gains alone need not multiply to the whole)")
    modes = {c.estimate.accumulation_sync for c in (cur, best, *(g.alone for g in cmp.gains if g.alone))} - {None}
    if len(modes) > 1:  # rows at different sync modes: say so (every: each micro-batch; last: no-sync)
        out.append("  ! the rows differ in gradient sync (every: reduce-scatter after each micro-batch; last: "
                   "no-sync until the last): see each row's sync")
    return "\n".join(out)


def _config_json(c: Any, ref: Any) -> dict[str, Any]:
    return {"label": c.plan.label, "micro_batch": c.micro_batch, "accumulation": c.accumulation,
            "sync": c.estimate.accumulation_sync,
            "step_s": c.estimate.step_s, "peak_bytes": c.estimate.peak_bytes,
            "tokens_per_s_per_gpu_ratio": c.sequences_per_s_per_rank / ref.sequences_per_s_per_rank}


def current_json(cmp: Any) -> dict[str, Any]:
    return {"description": cmp.current_text, "current": _config_json(cmp.current, cmp.current),
            "wrapopt": _config_json(cmp.chosen, cmp.current), "speedup": cmp.speedup,
            "choices": [{"dimension": g.dimension, "current": g.current, "wrapopt": g.chosen,
                         **({"alone": _config_json(g.alone, cmp.current)} if g.alone else {"why_not": g.why_not})}
                        for g in cmp.gains]}
