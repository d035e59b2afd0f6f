"""Which fitting plan a search hands back: the simplest within the simulator's error.

[Note: plans within the error] The simulator misses. A plan predicted a
fraction of a percent faster than one unit per block, for gigabytes more
memory and a cut nobody has run, is not a better plan: it is noise in the
prediction bought with memory.
So ``choose`` does not return the fastest fitting plan. It returns:

1. among the plans that fit the budget less ``MEMORY_ERROR`` (the memory
   model's measured error: a plan that fits only without that margin may not
   fit at all; the strategies aim at that allowance, ``search_plan``), or,
   when none does, among all the fitting plans;
2. the conventional cut (``is_per_block``: one unit per block, any reshard
   and checkpointing, any shard group; the simplest of those within
   ``STEP_ERROR`` of their fastest), unless some plan beats it by more than
   ``STEP_ERROR`` (the step model's measured error
   between plans);
3. in the group that wins (the per-block cuts, or the plans that beat them by
   more than the error), the simplest of those within ``STEP_ERROR`` of the
   group's fastest: fewest checkpointed units, then fewest units, then fewest
   units kept unsharded after forward, then the fastest.

``Choice.why`` says in one line which case it was, naming the plan it chose
(``describe_cut``: "per-block with 67 of 80 blocks checkpointed + tp4", not
the bare convention's name) and why: its margin over the convention, and
the memory that made it checkpoint. The fastest fitting plan stays on the
result (``SearchResult.fastest``) and in the Pareto front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from wrapopt.fileio import fmt_bytes
from wrapopt.search.strategy import Scored, fastest
from wrapopt.spec import ModelGraph, PlanSpec

__all__ = ["STEP_ERROR", "MEMORY_ERROR", "ERROR_SOURCE", "Choice", "choose", "is_per_block", "describe_cut"]

# The largest |paired ratio - 1| of the measured step of the predicted-fastest plan to the
# measured-fastest plan over the fidelity cases (results/fidelity.md, results/fidelity_train.md):
# the worst case, since the median is 0 and would call every prediction exact. See [Note: plans
# within the error].
STEP_ERROR = 0.048
# The worst peak-memory error of results/fidelity.md.
MEMORY_ERROR = 0.04
ERROR_SOURCE = (f"worst measured miss: step {STEP_ERROR:.1%} (predicted- vs measured-fastest, paired, "
                f"results/fidelity.md and fidelity_train.md), peak {MEMORY_ERROR:.1%} (results/fidelity.md)")


@dataclass(frozen=True)
class Choice:
    """What ``choose`` picked, and why, in one line."""

    best: Scored
    fastest: Scored  # the fastest fitting plan, whatever its cut
    per_block: Scored | None  # the per-block cut the choice was measured against; None when none fits
    why: str


def is_per_block(graph: ModelGraph, plan: PlanSpec) -> bool:
    """One unit per block of the block chains, and nothing else but the root."""
    if not graph.blocks:
        return False
    units = sorted(u.modules for u in plan.units if not u.is_root)
    return units == sorted((b,) for b in graph.blocks)


def describe_cut(graph: ModelGraph, plan: PlanSpec) -> str:
    """A one-unit-per-block plan in words: "per-block" when every block is resharded and none
    checkpointed, else what differs ("per-block with 67 of 80 blocks checkpointed"), then its
    shard group, tensor-parallel and pipeline degrees and offload where set."""
    units = [u for u in plan.units if not u.is_root]
    n = len(units)
    counts = (("checkpointed", sum(bool(u.checkpoint) and not u.selective_checkpoint for u in units)),
              ("selective-op checkpointed", sum(u.selective_checkpoint for u in units)),
              ("kept unsharded after forward", sum(u.reshard_after_forward is False for u in units)),
              ("resharded to a smaller group", sum(type(u.reshard_after_forward) is int for u in units)))
    parts = [(f"every block {what}" if k == n else f"{k} of {n} blocks {what}") for what, k in counts if k]
    mesh = plan.mesh
    text = "per-block" + (f" with {', '.join(parts)}" if parts else "")
    if 1 < mesh.shard_size < mesh.dp_size:
        text += f", HSDP shard group {mesh.shard_size}"
    elif mesh.shard_size == 1 and mesh.dp_size > 1:
        text += ", not sharded"
    text += (f" + tp{mesh.tp_size}" if mesh.tp_size > 1 else "") + (f" + pp{mesh.pp_size}" if mesh.pp_size > 1 else "")
    return text + (", CPU offload" if plan.offload else "")


def _checkpoints(s: Scored) -> int:
    return sum(bool(u.checkpoint) for u in s.plan.units if not u.is_root)


def _complexity(s: Scored) -> tuple:
    units = [u for u in s.plan.units if not u.is_root]
    return (sum(bool(u.checkpoint) for u in units), len(s.plan.units),
            sum(u.reshard_after_forward is False for u in units), round(s.estimate.step_s, 12),
            s.estimate.peak_bytes)


def _simplest(group: Sequence[Scored]) -> Scored:
    """The simplest plan of ``group`` within ``STEP_ERROR`` of its fastest."""
    top = fastest(list(group))
    assert top is not None
    near = [s for s in group if s.estimate.step_s <= top.estimate.step_s * (1 + STEP_ERROR)]
    return min(near, key=_complexity)


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def choose(graph: ModelGraph, fitting: Sequence[Scored], budget: float) -> Choice:
    """The plan a search hands back among ``fitting`` (non-empty, each within ``budget``).
    See [Note: plans within the error]."""
    top = fastest(list(fitting))
    assert top is not None
    limit = budget * (1 - MEMORY_ERROR)
    pool = [s for s in fitting if s.estimate.peak_bytes <= limit]
    margin = "" if pool or math.isinf(budget) else (
        f"; no plan keeps the memory model's {_pct(MEMORY_ERROR)} margin below the budget "
        f"(the smallest peak is {fmt_bytes(min(s.estimate.peak_bytes for s in fitting))} > {fmt_bytes(limit)})")
    pool = pool or list(fitting)
    blocks = [s for s in pool if is_per_block(graph, s.plan)]
    err = f"the simulator's {_pct(STEP_ERROR)} error"
    if not blocks:
        best = _simplest(pool)
        if not graph.blocks:
            why = f"no block chain: the simplest plan within {err} of the fastest"
        else:
            pb = [s for s in fitting if is_per_block(graph, s.plan)]
            why = ("per-block " + (f"peaks at {fmt_bytes(min(s.estimate.peak_bytes for s in pb))}, over the budget "
                                   f"less the memory model's {_pct(MEMORY_ERROR)} error ({fmt_bytes(limit)})"
                                   if pb else "does not fit the budget")
                   + f": the simplest plan within {err} of the fastest")
        return Choice(best, top, None, why + margin)
    ref = _simplest(blocks)
    ref_s = ref.estimate.step_s  # what another cut must beat by more than the error
    better = [s for s in pool if s.estimate.step_s * (1 + STEP_ERROR) < ref_s]
    ref_text = describe_cut(graph, ref.plan)
    if not better:
        gain = 1 - top.estimate.step_s / ref_s
        why = (f"{ref_text}: nothing beats it by more than {err}"
               + (f" (the fastest plan is {_pct(gain)} faster)" if gain >= 0.0005 else "")
               + _memory_reason(ref, blocks, fitting, budget, limit))
        return Choice(ref, top, ref, why + margin)
    best = _simplest(better)
    # As the rule above measures it: per-block's step over this plan's, less one.
    why = f"beats per-block by {_pct(ref_s / best.estimate.step_s - 1)} (> {err})"
    if ref_text != "per-block":  # the convention it beat, as it fits here
        why += f"; per-block here: {ref_text}, {ref_s * 1e3:.4g} ms"
    return Choice(best, top, ref, why + margin)


def _memory_reason(ref: Scored, blocks: Sequence[Scored], fitting: Sequence[Scored], budget: float,
                   limit: float) -> str:
    """Why the per-block cut ``ref`` checkpoints blocks: no per-block cut checkpointing fewer
    fits the budget less the memory model's margin (""; nothing checkpointed, or a cut with
    fewer is slower by more than the error)."""
    k = _checkpoints(ref)
    if not k or any(_checkpoints(s) < k for s in blocks):
        return ""
    fewer = [s for s in fitting if _same_cut(ref, s) and _checkpoints(s) < k]
    smallest = min((s.estimate.peak_bytes for s in fewer), default=None)
    over = f" (the smallest peaks at {fmt_bytes(smallest)})" if smallest is not None else ""
    where = (f"the budget less the memory model's {_pct(MEMORY_ERROR)} margin, {fmt_bytes(limit)}"
             if not math.isinf(budget) else "the budget")
    return f"; {k} checkpointed: no per-block cut checkpointing fewer fits {where}{over}"


def _same_cut(ref: Scored, s: Scored) -> bool:
    """``s`` has ``ref``'s units (the same per-block cut, any reshard and checkpointing)."""
    return sorted(u.modules for u in s.plan.units) == sorted(u.modules for u in ref.plan.units)
