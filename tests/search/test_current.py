"""The user's current configuration (search/current.py): the description parsed into a plan
and a micro-batch, bad descriptions named with the accepted forms, the comparison beside the
search's plan, and ``wrapopt search --current``."""

from __future__ import annotations

import json

import pytest

from wrapopt.cli.main import main
from wrapopt.cost import Simulator
from wrapopt.errors import OptionError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.report.current import current_json, format_current
from wrapopt.search.current import CURRENT_FORMS, compare_current, parse_current
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.train import TrainConfig

MESH = MeshSpec(world_size=8, ranks_per_node=4, shard_size=8)


@pytest.fixture(scope="module")
def llama_a100(llama_tiny):
    """llama-tiny's graph, a simulator of 8 A100s (4 a node) on IB 200, and the training step it scores."""
    _model, _inputs, graph = llama_tiny
    train = TrainConfig()
    sim = Simulator(graph, analytical_fabric("a100+ib200", world_size=8, ranks_per_node=4),
                    analytical_compute("a100"), train.sim_options())
    return graph, sim, train


def test_a_description_gives_the_plan_it_says(llama_tiny):
    _model, _inputs, graph = llama_tiny
    cur = parse_current("per-block, full AC, micro-batch 2", graph, MESH)
    inner = [u for u in cur.plan.units if not u.is_root]
    assert cur.micro_batch == 2 and len(inner) == len(graph.blocks) and all(u.checkpoint for u in inner)
    assert all(u.reshard_after_forward is True for u in inner) and cur.plan.mesh == MESH
    every2 = parse_current("AC every 2nd block; no reshard; shard 4", graph, MESH).plan
    assert [u.checkpoint for u in every2.units if not u.is_root] == [False, True] * 3
    assert all(u.reshard_after_forward is False for u in every2.units if not u.is_root)
    assert every2.mesh.shard_size == 4 and every2.mesh.is_hsdp
    tp = parse_current("tp 2", graph, MESH).plan
    assert tp.mesh.tp_size == 2 and tp.tp is not None and tp.mesh.world_size == 8
    default = parse_current("no AC", graph, MESH)
    assert default.micro_batch is None and not any(u.checkpoint for u in default.plan.units)


@pytest.mark.parametrize("text, words", [
    ("per-blok", "cannot read 'per-blok'"),
    ("per-block, micro-batch 0", "needs a positive count"),
    ("shard 3", "shard 3 does not divide the 8 data-parallel ranks"),
    ("tp 3", "tp 3 does not divide the 4 ranks per node"),
    ("", "nothing given"),
])
def test_a_bad_description_names_the_item_and_the_forms(llama_tiny, text, words):
    _model, _inputs, graph = llama_tiny
    with pytest.raises(OptionError) as exc:
        parse_current(text, graph, MESH)
    assert words in str(exc.value) and CURRENT_FORMS in str(exc.value)


def test_the_comparison_scores_each_differing_choice_alone(llama_a100):
    graph, sim, train = llama_a100
    cur = parse_current("per-block, full AC", graph, MESH)
    best = search_plan(graph, sim, MESH, options=SearchOptions(trials=0)).best
    cmp = compare_current(graph, sim, cur, best.plan, request=ParallelRequest(mesh=MESH, train=train),
                          chosen_micro_batch=None)
    # the current one scored as the simulator scores it directly
    assert cmp.current.estimate.step_s == pytest.approx(sim.simulate(cur.plan).step_s)
    assert cmp.chosen.estimate.step_s == pytest.approx(best.estimate.step_s)
    assert cmp.speedup == pytest.approx(cmp.current.estimate.step_s / best.estimate.step_s)
    ck = next(g for g in cmp.gains if g.dimension == "checkpointing")
    assert ck.current == "every unit full" and ck.alone is not None
    assert ck.alone.estimate.step_s < cmp.current.estimate.step_s  # no recompute: faster
    text = format_current(cmp)
    assert "checkpointing: every unit full ->" in text and f"x{cmp.speedup:.3f}" in text
    assert current_json(cmp)["choices"][0]["dimension"] in {g.dimension for g in cmp.gains}


def test_at_a_global_batch_both_cover_the_same_sequences(llama_a100):
    graph, sim, train = llama_a100
    cur = parse_current("per-block, micro-batch 1", graph, MESH)
    best = search_plan(graph, sim, MESH, options=SearchOptions(trials=0)).best
    at_32 = ParallelRequest(mesh=MESH, train=train, global_batch=32)
    cmp = compare_current(graph, sim, cur, best.plan, request=at_32, chosen_micro_batch=4)
    assert (cmp.current.micro_batch, cmp.current.accumulation) == (1, 4)
    assert (cmp.chosen.micro_batch, cmp.chosen.accumulation) == (4, 1)
    assert any(g.dimension == "micro-batch" and g.current == "1" and g.chosen == "4" for g in cmp.gains)
    with pytest.raises(OptionError, match="micro-batch 3 x 8 data-parallel ranks does not divide the global batch"):
        compare_current(graph, sim, parse_current("micro-batch 3", graph, MESH), best.plan, request=at_32,
                        chosen_micro_batch=4)


def test_cli_search_current(capsys, tmp_path):
    args = ["search", "zoo:gpt-tiny", "--world-size", "4", "--gpus-per-node", "4", "--fabric", "a100+ib200",
            "--trials", "0"]
    assert main([*args, "--current", "per-block, full AC", "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "Current configuration (per-block, full AC)" in out and "checkpointing: every unit full ->" in out
    assert main([*args, "--json", "--current", str(tmp_path / "p.json")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["search"]["current"]["speedup"] == pytest.approx(1.0)  # its own plan: no gain
    assert main([*args, "--current", "per-block, fast"]) == 1
    assert "cannot read 'fast'" in capsys.readouterr().err


def test_a_pipeline_chosen_is_compared_whole(capsys, tmp_path):
    """[Note: the current configuration and a pipeline]: with --pp the chosen plan may be a pipeline;
    it is compared whole, at the same global batch, with the search's own estimate."""
    args = ["search", "zoo:llama-tiny", "--world-size", "8", "--gpus-per-node", "4", "--gpu", "h100-sxm",
            "--network", "ib400", "--pp", "2", "--global-batch", "64", "--trials", "0"]
    assert main([*args, "--json", "--current", "per-block", "--out", str(tmp_path / "pp.json")]) == 0
    data = json.loads(capsys.readouterr().out)
    cur = data["search"]["current"]
    (choice,) = cur["choices"]
    assert choice["dimension"] == "pipeline" and choice["current"] == "none" and choice["wrapopt"].startswith("pp2 ")
    assert "not taken apart" in choice["why_not"]
    plan = json.loads((tmp_path / "pp.json").read_text())
    m = plan["pipeline"]["microbatches"]
    # the same 64 sequences a step: the current plan's 8 ranks x micro-batch x accumulation, the pipeline's
    # 4 pipelines x micro-batch x its micro-batches
    assert cur["current"]["micro_batch"] * cur["current"]["accumulation"] * 8 == 64
    assert cur["wrapopt"]["micro_batch"] * m * 4 == 64 and cur["wrapopt"]["accumulation"] == m
    assert cur["speedup"] == pytest.approx(cur["current"]["step_s"] / cur["wrapopt"]["step_s"])
    # a plan file with stages as the current configuration: compared whole too; its own plan gains nothing
    assert main([*args, "--json", "--current", str(tmp_path / "pp.json")]) == 0
    again = json.loads(capsys.readouterr().out)["search"]["current"]
    assert again["choices"][0]["current"] == again["choices"][0]["wrapopt"] == choice["wrapopt"]
    assert again["speedup"] == pytest.approx(1.0, rel=1e-6)
