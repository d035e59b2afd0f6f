"""Per-stage refinement of pipeline plans ([Note: per-stage refinement]): each stage's FSDP plan
searched apart replaces the shape shared by the stages only when it fits and beats it by more
than the simulator's error, and what it gives is a legal pipeline plan."""

from __future__ import annotations

import pytest

from wrapopt.cost.pipeline import stage_units
from wrapopt.cost.simulate import Simulator
from wrapopt.fingerprint import model_fingerprint
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.plan.stages import stage_layout
from wrapopt.search.choose import MEMORY_ERROR, STEP_ERROR
from wrapopt.search.pipeline import search_pipeline_degree
from wrapopt.search.pipeline_stages import REFINED
from wrapopt.search.stages import pipeline_layout
from wrapopt.spec import MeshSpec, Shape
from wrapopt.trace.meta import trace_model
from wrapopt.units import validate_plan


@pytest.fixture(scope="module")
def models():
    out = {}
    for name in ("llama-tiny", "llama-7b"):
        model, x = zoo.build(name, "meta")
        out[name] = (model, trace_model(model, x))
    return out


def _search(g, world, budget_of_smallest):
    """Degree 2's answer at ``budget_of_smallest`` times the smallest peak it reaches without a budget."""
    mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)
    sim = Simulator(g, analytical_fabric(world_size=world, ranks_per_node=world), analytical_compute())
    _, scored, _ = search_pipeline_degree(g, sim, mesh, pipeline_layout(g), shape=Shape(pp=2), spec=None,
                                          memory_budget=None)
    budget = min(s.estimate.peak_bytes for s in scored) * budget_of_smallest
    best, scored, why = search_pipeline_degree(g, sim, mesh, pipeline_layout(g), shape=Shape(pp=2), spec=None,
                                               memory_budget=budget)
    aim = budget * (1 - MEMORY_ERROR)
    shared = min((s for s in scored if s.strategy == "pipeline" and s.estimate.peak_bytes <= aim),
                 key=lambda s: s.estimate.step_s)
    return best, shared, scored, budget, why


def _checkpointed(plan):
    return [sum(bool(u.checkpoint) for u in units[:-1]) for units in stage_units(plan)]


def test_stages_searched_apart_checkpoint_fewer_blocks_and_win(models):
    """llama-7b, 2 stages x 2 ranks, a budget where the shared shape checkpoints every block:
    the refined plan checkpoints fewer on some stage, fits, and is faster by more than the error
    (6.7% against 4.8%; on 2 stages x 4 ranks the refined plans gain 4.5%, which the error keeps out)."""
    _, g = models["llama-7b"]
    best, shared, _, budget, why = _search(g, 4, 1.3)
    assert why == "fits" and best.strategy == REFINED and best is not shared
    assert all(u.checkpoint for u in shared.plan.units if not u.is_root)  # the shared shape: every block
    assert best.estimate.peak_bytes <= budget * (1 - MEMORY_ERROR) and best.fits
    assert best.estimate.step_s * (1 + STEP_ERROR) < shared.estimate.step_s
    assert sum(_checkpointed(best.plan)) < sum(_checkpointed(shared.plan))
    assert best.plan.pipeline == shared.plan.pipeline and best.plan.root == shared.plan.root
    assert "vs one shape" in best.plan.label


def test_the_shared_shape_is_kept_when_nothing_beats_it_by_more_than_the_error(models):
    """llama-tiny, 2 stages x 2 ranks, a tight budget: a stage-refined plan is found, faster,
    but by less than the error: the shared-shape plan is the answer."""
    _, g = models["llama-tiny"]
    best, shared, scored, _, why = _search(g, 4, 1.05)
    refined = [s for s in scored if s.strategy == REFINED]
    assert why == "fits" and best is shared and refined
    assert all(r.estimate.step_s * (1 + STEP_ERROR) >= shared.estimate.step_s or not r.fits for r in refined)


def test_a_refined_plan_is_a_legal_pipeline_plan(models, tmp_path):
    """Its units pass ``validate_plan``, each lies in one stage, the stages check against the
    model as ``apply_pipeline`` checks them, and the plan file round-trips."""
    model, g = models["llama-7b"]
    best, _, _, _, _ = _search(g, 8, 1.5)
    validate_plan(g, best.plan)
    assert sum(len(u) - 1 for u in stage_units(best.plan)) == len(best.plan.units) - 1
    stage_layout(model, best.plan)
    path = tmp_path / "pp.json"
    WrapPlan(spec=best.plan, model=model_fingerprint(model)).save(path)
    assert WrapPlan.load(path).spec == best.plan
