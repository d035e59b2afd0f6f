"""The 3-D search ([Note: pipeline search], [Note: stage split]): balanced splits, refusals,
the degree chosen, and ``wrapopt search --pp`` writing a plan file that loads back."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

from wrapopt.cli.main import main
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import OptionError, PlanError
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.search.driver import SearchOptions
from wrapopt.search.pipeline import pipeline_plan, pp_group_sizes, resolve_pp, search_pipeline_degree
from wrapopt.search.run import run_search
from wrapopt.search.stages import balanced_split, check_stage_count, pipeline_layout, stage_modules, weights
from wrapopt.spec import MeshSpec, ParallelRequest, Shape
from wrapopt.trace.meta import trace_model
from wrapopt.train import TrainConfig


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name in ("llama-tiny", "t5-tiny", "gpt-tiny"):
        model, x = zoo.build(name, "meta")
        out[name] = trace_model(model, x)
    return out


def _sim(g, world=4):
    return Simulator(g, analytical_fabric(world_size=world, ranks_per_node=4), analytical_compute())


def _slowest(w, first, last, sizes):
    at, worst = 0, 0.0
    for s, k in enumerate(sizes):
        t = w[at:at + k].sum() + (first if s == 0 else 0) + (last if s == len(sizes) - 1 else 0)
        worst, at = max(worst, t), at + k
    return worst


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_split_is_as_balanced_as_any(graphs, stages):
    """No split of llama-tiny's blocks has a faster slowest stage than the one chosen (brute force)."""
    g = graphs["llama-tiny"]
    layout = pipeline_layout(g)
    w, first, last = weights(g, _sim(g), MeshSpec(world_size=2, ranks_per_node=2, shard_size=2), layout)
    assert len(w) == 6 and first > 0 and last > 0  # embeddings; norm, head and loss
    sizes = balanced_split(w, first, last, stages)
    assert sum(sizes) == 6 and min(sizes) >= 1
    n = len(w)
    best = min(_slowest(w, first, last, tuple(b - a for a, b in zip((0, *cuts), (*cuts, n))))
               for cuts in itertools.combinations(range(1, n), stages - 1))
    assert _slowest(w, first, last, sizes) == pytest.approx(best)


def test_split_moves_blocks_off_a_heavy_end():
    assert balanced_split(np.ones(8), 0.0, 3.0, 2) == (5, 3)
    assert balanced_split(np.ones(8), 0.0, 0.0, 4) == (2, 2, 2, 2)


def test_stage_modules_put_the_ends_on_the_end_stages(graphs):
    layout = pipeline_layout(graphs["llama-tiny"])
    stages = stage_modules(layout, (3, 3))
    assert stages[0] == ("embed_tokens", "layers.0", "layers.1", "layers.2")
    assert stages[1] == ("layers.3", "layers.4", "layers.5", "norm", "lm_head")


def test_encoder_decoder_is_refused_for_pipelining_and_auto_searches_without(graphs):
    g = graphs["t5-tiny"]
    with pytest.raises(PlanError, match="one sequential chain.*2 block chains.*--pp 1"):
        pipeline_layout(g)
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=4)
    with pytest.raises(PlanError, match="2 block chains"):
        resolve_pp(g, ParallelRequest(mesh=mesh, pp=2))
    degrees, layout, notes = resolve_pp(g, ParallelRequest(mesh=mesh, pp="auto"))
    assert degrees == (1,) and layout is None and "pipelining not tried" in notes[0]


def test_auto_on_a_model_that_cannot_be_pipelined_searches_without(graphs):
    g = graphs["t5-tiny"]
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=4)
    found = run_search(g, _sim(g), ParallelRequest(mesh=mesh, train=TrainConfig(), pp="auto"), memory_budget=None,
                       options=SearchOptions(trials=0))
    assert found.result.best.plan.pipeline is None and any("pipelining not tried" in n for n in found.notes)


def test_a_tied_embedding_and_head_split_across_stages_pay_their_gradient_sum(graphs):
    """[Note: tied copies on stages]: the head on the last stage holds a copy of the embedding's weight;
    each step sums the copies' gradients over the two pipeline ranks."""
    from wrapopt.cost.pipeline import compose_pipeline, price_stage, stage_simulators
    from wrapopt.cost.stage_view import tied_sync_s

    g = graphs["gpt-tiny"]
    layout = pipeline_layout(g)
    assert layout.before == ("wte", "wpe") and layout.after == ("ln_f", "lm_head")
    sim = _sim(g)
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, pp_size=2)
    plan = pipeline_plan(layout, (2, 2), mesh, schedule="1F1B", microbatches=4, reshard=True, checkpoint="none",
                         tp_spec=None, label="pp2")
    sync = tied_sync_s(g, plan, sim.fabric)
    (shape,) = [s[1] for s in g.param_shapes if s[0] == "wte.weight"]
    want = sim.fabric.collective_s("all_reduce", 2, 2, shape[0] * shape[1] * 4 / 2)[0]
    assert sync == pytest.approx(want) and sync > 0
    views = stage_simulators(sim, plan)
    stages = [price_stage(ssim, units, plan, last=i == len(views) - 1) for i, (ssim, units) in enumerate(views)]
    assert sim.simulate(plan).step_s == pytest.approx(compose_pipeline(sim.fabric, plan, stages).step_s + sync)
    assert stages[1].static_bytes > price_stage(*stage_simulators(Simulator(replace(g, tied_groups=()), sim.fabric,
                                                                            sim.compute), plan)[1], plan,
                                                last=True).static_bytes  # the copy's parameters and state
    found = run_search(g, sim, ParallelRequest(mesh=MeshSpec(world_size=4, ranks_per_node=4, shard_size=4),
                                               train=TrainConfig(), pp=2),
                       memory_budget=None, options=SearchOptions(trials=0))
    assert found.result.best.plan.pipeline is not None


def test_forced_degree_that_cannot_give_each_stage_a_block(graphs):
    g = graphs["llama-tiny"]
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    with pytest.raises(PlanError, match=r"--pp 8: 6 blocks cannot give each of 8 stages a block; .*: 2, 4"):
        resolve_pp(g, ParallelRequest(mesh=mesh, pp=8))
    with pytest.raises(OptionError, match="does not divide the world of 8"):
        ParallelRequest(mesh=mesh, pp=3)
    with pytest.raises(PlanError, match=r"needs 8 stages, more than the 6 blocks; virtual stages that fit: 1"):
        check_stage_count(pipeline_layout(g), 4, 2, 8)
    assert resolve_pp(g, ParallelRequest(mesh=mesh, pp="auto"))[0] == (1, 2, 4)


def test_degree_search_returns_its_fastest_fitting_plan(graphs):
    g = graphs["llama-tiny"]
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=4)
    best, scored, why = search_pipeline_degree(g, _sim(g), mesh, pipeline_layout(g), shape=Shape(pp=2), spec=None,
                                               memory_budget=None)
    assert why == "fits" and best.plan.mesh.pp_size == 2 and best.plan.pipeline is not None
    assert best.estimate.step_s == min(s.estimate.step_s for s in scored)
    assert {s.plan.pipeline.schedule for s in scored} == {"GPipe", "1F1B", "Interleaved1F1B"}
    assert all(s.plan.pipeline.microbatches >= 2 for s in scored)
    # a budget below the pipeline's smallest peak: nothing fits, and it says so
    low = min(s.estimate.peak_bytes for s in scored) * 0.5
    none, _, why = search_pipeline_degree(g, _sim(g), mesh, pipeline_layout(g), shape=Shape(pp=2), spec=None,
                                          memory_budget=low)
    assert none is None and why.startswith("nothing fits")


def test_pp_1_is_todays_search(graphs):
    g = graphs["llama-tiny"]
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=4)
    sim = _sim(g)
    opts = SearchOptions(trials=0)
    kw = dict(memory_budget=None, options=opts)
    plain = run_search(g, sim, ParallelRequest(mesh=mesh, train=TrainConfig(), pp=None), **kw).result
    one = run_search(g, sim, ParallelRequest(mesh=mesh, train=TrainConfig(), pp="1"), **kw).result
    assert one.best.plan == plain.best.plan and one.best.estimate == plain.best.estimate and not one.pp_rows
    auto = run_search(g, sim, ParallelRequest(mesh=mesh, train=TrainConfig(), pp="auto"), **kw).result
    assert {d for d, _ in auto.pp_tried} == {1, 2, 4}
    rows = dict(auto.pp_rows)
    assert rows["best pp1 (no pipeline)"].estimate == plain.best.estimate


def test_cli_search_pp_2_writes_a_pipeline_plan_that_loads(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", "zoo:llama-tiny", "--world-size", "4", "--pp", "2", "--trials", "0",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pipeline degrees" in text and "best pp2" in text
    plan = WrapPlan.load(str(out))
    assert plan.mesh.pp_size == 2 and plan.spec.pipeline is not None
    assert plan.spec.pipeline.schedule in ("GPipe", "1F1B", "Interleaved1F1B")
    assert json.loads(out.read_text())["mesh"]["pp_size"] == 2


def test_cli_estimate_pp_and_search_refusal(tmp_path, capsys):
    assert main(["estimate", "zoo:llama-tiny", "--world-size", "4", "--pp", "2", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["mesh"]["pp_size"] == 2
    assert main(["search", "zoo:t5-tiny", "--world-size", "4", "--pp", "2", "--trials", "0"]) == 1
    assert "one sequential chain" in capsys.readouterr().err


def test_combine_prefers_plans_within_the_memory_margin():
    from types import SimpleNamespace as NS

    from wrapopt.search.choose import MEMORY_ERROR
    from wrapopt.search.pipeline import combine

    budget = 100.0

    def scored(step, peak, label):
        return NS(estimate=NS(step_s=step, peak_bytes=peak), plan=NS(label=label, mesh=NS(cp_size=1)),
                  fits=peak <= budget)

    inside, past = scored(2.0, budget * (1 - MEMORY_ERROR) - 1, "a"), scored(1.0, budget - 0.5, "b")
    res = combine(None, {2: inside, 4: past}, {}, [inside, past], None, budget)
    assert res.best is inside
    assert "margin" in dict(res.pp_tried)[4] and dict(res.pp_tried)[2] == "chosen"
    assert [label for label, _ in res.pp_rows] == ["best pp2", "best pp4"]
    # nothing within the margin: the fastest that fits the budget
    res = combine(None, {4: past}, {}, [past], None, budget)
    assert res.best is past


@pytest.mark.parametrize("pp, world, rpn, sizes", [
    (None, 4, 4, ()), ("1", 4, 4, ()),
    (2, 4, 4, (2,)),  # a stage is 2 consecutive ranks, its sends a pair inside the node
    ("auto", 4, 4, (2,)),  # degree 4: stages of one rank, sends between pairs
    ("auto", 16, 8, (2, 4)),  # degree 2: stages of whole nodes (the intra axis); 4 and 8: 4 and 2 ranks
    (2, 16, 8, ()),  # stages are nodes: measured already, sends over the inter axis
])
def test_pp_group_sizes_are_the_stages_inside_a_node(pp, world, rpn, sizes):
    mesh = MeshSpec(world_size=world, ranks_per_node=rpn, shard_size=world)
    assert pp_group_sizes(ParallelRequest(mesh=mesh, pp=pp)) == sizes


def test_a_measured_search_with_a_pipeline_measures_its_stage_groups(monkeypatch):
    from wrapopt import api

    seen = {}

    def fake_fabric(**kwargs):
        seen.update(kwargs)
        return analytical_fabric(world_size=4)

    monkeypatch.setattr(api.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(api.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(api, "measure_fabric", fake_fabric)
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=4)
    fab, _ = api._profiles(None, analytical_compute(), request=ParallelRequest(mesh=mesh, pp="auto"), graph=None,
                           model=None, measure=True)
    assert seen["group_sizes"] == (2,) and fab.world_size == 4
    api._profiles(None, analytical_compute(), request=ParallelRequest(mesh=mesh), graph=None, model=None,
                  measure=True)
    assert seen["group_sizes"] == ()
