"""Per-stage refinement of a pipeline plan: each stage's FSDP plan searched by the 1-D search.

[Note: per-stage refinement] The two passes of [Note: pipeline search] give every stage of a
pipeline plan one shared shape. After them, the ``REFINE_TOP`` fastest plans of a pipeline
degree (those that fit) have their stages searched one at a time, in stage order, by
``search_plan`` (baselines, the exact DP over the stage's blocks, uniform groupings; no study)
on the stage's own simulator (``stage_simulators`` in cost/pipeline.py: one micro-batch,
gradients held unsynchronised) and data-parallel mesh, its shard group only (the plan has one
mesh). A stage may so group blocks into one unit, keep some units unsharded after forward, and
checkpoint only the blocks that need it. The root unit stays the shared plan's.

*The stage's budget*: the stage simulator's peak is one micro-batch's; the rank holds more: the
other in-flight micro-batches' activations, the units a backward left gathered, and the other
stages on the rank (Interleaved1F1B). So the stage is searched under the limit less what its
rank holds beyond the stage's own peak, ``rank_peaks`` (as ``simulate_pipeline`` counts them)
less the stage simulator's peak, taken with the stage's current plan (the others' as refined
so far). A plan found that way holds more activations per micro-batch than the shared shape
did, so its rank may still be over: then the stage is searched again under the limit less that
plan's extra, which is larger (fewer checkpoints, more bytes in flight), up to ``_TRIES`` times;
a plan whose smaller budget buys fewer activations fits where the one before did not. A stage
with no fitting answer keeps its shape. The limit is the one the shared plan was chosen under:
the budget less the memory model's error when it fits that, else the budget.

*Keeping it*: the assembled plan (every stage's units, the root, the same ``PipelineSpec``) is
scored by ``Simulator.simulate`` (the pipeline's own memory and timeline: this is what
guarantees the fit) and replaces the degree's shared-shape plan only if it fits the same limit
and is faster by more than ``STEP_ERROR`` ([Note: plans within the error] in search/choose.py:
one shape for every stage is the simpler plan); its label says by how much.
"""

from __future__ import annotations

from dataclasses import replace

from wrapopt.cost.pipeline import price_stage, rank_peaks, stage_simulators
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.search.choose import MEMORY_ERROR, STEP_ERROR
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.search.strategy import Scored
from wrapopt.spec import PlanSpec, UnitSpec

__all__ = ["REFINE_TOP", "REFINED", "refine_stages", "refined_over"]

REFINE_TOP = 2  # the fastest fitting pipeline plans of a degree whose stages are searched apart
REFINED = "pipeline-stages"  # ``Scored.strategy`` of a plan whose stages were searched apart
_TRIES = 3  # budgets tried per stage (See [Note: per-stage refinement])


def refine_stages(sim: Simulator, shared: Scored, *, memory_budget: float | None) -> Scored | None:
    """``shared`` (a pipeline plan) with each stage's FSDP plan searched apart, scored by
    ``sim.simulate``; None when no stage found another plan. See [Note: per-stage refinement]."""
    plan = shared.plan
    pipe = plan.pipeline
    assert pipe is not None
    budget = float(memory_budget) if memory_budget else float("inf")
    limit = budget * (1 - MEMORY_ERROR) if shared.estimate.peak_bytes <= budget * (1 - MEMORY_ERROR) else budget
    views = stage_simulators(sim, plan)
    units = [tuple(u) for _, u in views]
    n, p = len(views), plan.mesh.pp_size
    costs = [price_stage(ssim, u, plan, last=s == n - 1) for s, (ssim, u) in enumerate(views)]
    mesh = plan.mesh.data_parallel()
    opts = SearchOptions(trials=0, shard_sizes=(mesh.shard_size,))
    changed = False
    for s, (ssim, _) in enumerate(views):
        extra = rank_peaks(plan, costs)[s % p] - costs[s].estimate.peak_bytes
        for _ in range(_TRIES):
            if limit - extra <= 0:
                break
            try:  # the search aims at its budget less the memory error: give it the limit's share
                found = search_plan(ssim.graph, ssim, mesh, memory_budget=(limit - extra) / (1 - MEMORY_ERROR),
                                    options=opts).best.plan
            except InfeasibleError:
                break
            mine = (*(u for u in found.units if not u.is_root), plan.root)
            if mine == units[s]:
                break
            cost = price_stage(ssim, mine, plan, last=s == n - 1)
            trial = [*costs[:s], cost, *costs[s + 1:]]
            peak = rank_peaks(plan, trial)[s % p]
            if peak <= limit:
                units[s], costs, changed = mine, trial, True
                break
            extra = peak - cost.estimate.peak_bytes
    if not changed:
        return None
    refined = replace(plan, units=(*(u for stage in units for u in stage[:-1]), plan.root))
    est = sim.simulate(refined)
    gain = shared.estimate.step_s / est.step_s - 1
    label = f"per-stage {_describe(refined.units)} + {_tail(refined)} ({gain * 100:+.1f}% vs one shape)"
    return Scored(replace(refined, label=label), est, est.peak_bytes <= budget, strategy=REFINED)


def refined_over(shared: Scored, refined: list[Scored], *, memory_budget: float | None) -> Scored:
    """``shared`` (a degree's fastest shared-shape plan), or the fastest of ``refined`` that fits
    the limit ``shared`` was chosen under and beats it by more than ``STEP_ERROR``."""
    budget = float(memory_budget) if memory_budget else float("inf")
    aim = budget * (1 - MEMORY_ERROR)
    limit = aim if shared.estimate.peak_bytes <= aim else budget
    better = [r for r in refined if r.estimate.peak_bytes <= limit
              and r.estimate.step_s * (1 + STEP_ERROR) < shared.estimate.step_s]
    return min(better, key=lambda r: (r.estimate.step_s, r.estimate.peak_bytes)) if better else shared


def _describe(units: tuple[UnitSpec, ...]) -> str:
    """The units of every stage in a few words: how many, kept unsharded, checkpointed."""
    body = [u for u in units if not u.is_root]
    kept = sum(u.reshard_after_forward is False for u in body)
    ckpt = sum(bool(u.checkpoint) for u in body)
    return f"{len(body)} units, {kept} keep, {ckpt} ckpt" if body else "root unit only"


def _tail(plan: PlanSpec) -> str:
    """The pipeline's part of a label: degree, schedule, virtual stages, micro-batches, tp, cp."""
    pipe, mesh = plan.pipeline, plan.mesh
    assert pipe is not None
    v = len(pipe.stages) // mesh.pp_size
    return (f"pp{mesh.pp_size} {pipe.schedule}{f' x{v}' if v > 1 else ''} m{pipe.microbatches}"
            + "".join(f" + {n}{d}" for n, d in (("tp", mesh.tp_size), ("cp", mesh.cp_size), ("ep", mesh.ep_size))
                      if d > 1))
