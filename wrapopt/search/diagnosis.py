"""Re-simulations around a search: what if the training step were set otherwise?

- ``score_given``: a plan the user brings, scored beside the baselines on its
  mesh, with no search.
- ``both_syncs``: under gradient accumulation, the chosen plan scored with
  each sync mode.
- ``assumptions_for``: what a prediction assumed, with the plan re-simulated
  under the smallest plausible loss when the loss holds much of the peak.

Each re-simulates with a ``Simulator`` of its own, on the fabric and compute of
the one it is given; none searches. When nothing fits, the remedies are priced by
``search/remedies.py`` (See [Note: computed remedies]).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

from wrapopt.assumptions import Assumptions, state_assumptions
from wrapopt.cost.simulate import Simulator
from wrapopt.search.baselines import baselines
from wrapopt.search.driver import SearchResult
from wrapopt.search.strategy import Scored
from wrapopt.spec import SYNC_MODES, CostEstimate, ModelGraph, PlanSpec
from wrapopt.train import TrainConfig

__all__ = ["score_given", "both_syncs", "assumptions_for"]


def score_given(graph: ModelGraph, sim: Simulator, spec: PlanSpec, budget: float | None) -> SearchResult:
    """A given plan scored by ``sim`` beside the baselines on its mesh (with its tensor
    parallelism, if any), as a ``SearchResult`` whose best is the given plan."""
    limit = float(budget) if budget else float("inf")

    def scored(p: PlanSpec) -> Scored:
        est = sim.simulate(p)
        return Scored(p, est, est.peak_bytes <= limit)

    mine = scored(spec)
    mesh = spec.mesh.data_parallel()
    base = {n: scored(p if spec.tp is None else replace(p, mesh=spec.mesh, tp=spec.tp))
            for n, p in baselines(graph, mesh).items()}
    return SearchResult(best=mine, baselines=base, candidates=(mine, *base.values()), memory_budget=limit,
                        notes=("plan given, not searched",))


def both_syncs(result: SearchResult, graph: ModelGraph, sim: Simulator, train: TrainConfig,
               budget: float | None) -> dict[str, CostEstimate]:
    """The search's choice simulated under each gradient sync mode (``SYNC_MODES``), on
    ``sim``'s fabric, compute and batch scale."""
    plan = result.best.plan
    out = {}
    for mode in SYNC_MODES:
        options = train.with_sync(mode).sim_options(memory_budget=budget, batch_scale=sim.options.batch_scale)
        out[mode] = Simulator(graph, sim.fabric, sim.compute, options, host=sim.host).simulate(plan)
    return out


def assumptions_for(graph: ModelGraph, sim: Simulator, plan: PlanSpec, estimate: CostEstimate, *,
                    memory_budget: float | None, source: str) -> Assumptions:
    """The assumptions of ``sim``'s prediction for ``plan``; when the loss keeps a large share
    of the peak, the plan re-simulated under the smallest plausible loss beside it
    (See [Note: smallest plausible loss] in assumptions.py)."""
    fields_ = dict(memory_budget=memory_budget, memory_budget_source=source, fabric=sim.fabric.name,
                   fabric_kind=sim.fabric.kind, compute=sim.compute.device, compute_kind=sim.compute.kind)
    stated = state_assumptions(graph, sim.options, plan=plan, peak_bytes=estimate.peak_bytes, **fields_)
    if not stated.loss_is_large:
        return stated
    lean = dataclasses.replace(graph, loss_saved_bytes=0, loss_peak_bytes=0, loss_grad_bytes=0)
    lean_peak = Simulator(lean, sim.fabric, sim.compute, sim.options, host=sim.host).simulate(plan).peak_bytes
    return dataclasses.replace(stated, smallest_loss_peak_bytes=lean_peak)
