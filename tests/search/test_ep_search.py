"""The expert-parallel degrees (search/ep.py) through the degree loop of search/axes.py: each degree
searched on its view beside FSDP alone under ``auto``, a given degree as given, and at a fixed
global batch each degree's splits compared by the step."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from wrapopt import zoo
from wrapopt.cli.main import main as cli
from wrapopt.cost.simulate import Simulator
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.search.driver import SearchOptions
from wrapopt.search.run import run_search
from wrapopt.search.shapes import shape_space
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.trace import trace_model
from wrapopt.train import TrainConfig

MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


@pytest.fixture(scope="module")
def moe():
    model, x = zoo.build("moe-tiny", "meta")
    return trace_model(model, x, fx=False)


def _search(capsys, *flags: str) -> dict:
    rc = cli(["search", "zoo:moe-tiny", "--world-size", "8", "--trials", "0", *flags, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_ep_auto_searches_each_degree_beside_fsdp_alone(moe):
    request = ParallelRequest(mesh=MESH, ep="auto")
    assert shape_space(moe, request).ep == (2, 4)  # the degrees dividing moe-tiny's 4 experts and the 8 ranks
    sim = Simulator(moe, analytical_fabric(world_size=8), analytical_compute())
    res = run_search(moe, sim, request, memory_budget=None, options=SearchOptions(trials=0)).result
    rows = dict(res.tp_rows)
    assert list(rows) == ["best without ep", "best ep2", "best ep4"]
    assert rows["best without ep"].plan.mesh.ep_size == 1
    for d in (2, 4):
        s = rows[f"best ep{d}"]
        assert s.plan.mesh.ep_size == d and s.plan.label.endswith(f" + ep{d}")
        assert s.plan.mesh.shard_size % d == 0  # whole ep groups in a shard group (FSDP or HSDP)
        assert s.estimate.step_s == pytest.approx(sim.simulate(s.plan).step_s)  # lifted: scores as the full mesh
    note = next(n for n in res.notes if n.startswith("expert parallel: "))
    assert all(f"ep {d}: " in note for d in (1, 2, 4)) and "chosen" in note
    chosen = res.best.plan.mesh.ep_size
    assert f"ep {chosen}: chosen" in note and res.best.estimate.step_s == rows[
        "best without ep" if chosen == 1 else f"best ep{chosen}"].estimate.step_s


def test_a_given_degree_is_searched_as_given(capsys):
    """``--ep 2`` is not traded for FSDP alone, however the two compare (as ``--tp 2`` is not)."""
    data = _search(capsys, "--ep", "2", "--memory", "none")
    assert data["mesh"]["ep_size"] == 2 and data["mesh"]["shard_size"] % 2 == 0
    assert data["label"].endswith(" + ep2") and not data["search"]["tp_rows"]  # FSDP alone not tried


def test_ep_at_a_fixed_global_batch_splits_as_fsdp_alone_and_compares_steps(capsys):
    """ep borrows data-parallel ranks: every degree's splits are micro-batch x accumulation x 8 ranks;
    the answer is a plan of its degree at its own split, and the report names each degree's best."""
    data = _search(capsys, "--ep", "auto", "--global-batch", "16", "--memory", "none")
    mesh, train = data["mesh"], data["train"]
    assert train["global_batch"] == 16 and train["micro_batch"] * train["grad_accumulation"] * 8 == 16
    rows = data["search"]["batch"]
    assert rows and all(r["dp_size"] == 8 and r["ep_size"] == mesh.get("ep_size", 1) for r in rows)
    labels = [r["row"] for r in data["search"]["tp_rows"]]
    assert labels[0].startswith("best without ep (") and any(x.startswith("best ep2 (") for x in labels)


def test_ep_in_a_pipeline_is_searched_per_stage_and_named_in_its_rows(capsys):
    """``--ep 2 --pp 2``: the pipeline's stages cut from one ep rank's model on 4 data-parallel ranks per
    stage (See [Note: ep in a pipeline] in search/shapes.py); under ``auto`` the note compares each
    pipeline degree's ep degrees by the step."""
    data = _search(capsys, "--ep", "2", "--pp", "2", "--memory", "none")
    mesh = data["mesh"]
    assert (mesh["pp_size"], mesh["ep_size"], mesh["shard_size"]) == (2, 2, 4)
    assert " pp2 " in data["label"] and " + ep2" in data["label"]
    rows = data["search"]["pipeline"]["rows"]
    assert rows and all(r["ep_size"] == 2 for r in rows)


def test_ep_auto_in_a_pipeline_compares_each_pipeline_s_degrees_by_the_step(moe):
    request = ParallelRequest(mesh=MESH, ep="auto", pp="auto")
    sim = Simulator(moe, analytical_fabric(world_size=8), analytical_compute())
    res = run_search(moe, sim, request, memory_budget=None, options=SearchOptions(trials=0)).result
    note = next(n for n in res.notes if n.startswith("expert parallel in the pipeline: "))
    assert all(f"pp{p} ep{d}: " in note for p, d in ((2, 1), (2, 2), (2, 4), (4, 1), (4, 2)))
    assert "pp4 ep4" not in note  # a stage of pp 4 has 2 ranks: fewer than ep 4
    for _label, s in res.pp_rows:  # each pipeline degree's best, priced as the full mesh
        assert s.estimate.step_s == pytest.approx(sim.simulate(s.plan).step_s)
    tight = run_search(moe, sim, request, memory_budget=4500 * 2**10, options=SearchOptions(trials=0)).result
    note = next(n for n in tight.notes if n.startswith("expert parallel in the pipeline: "))
    assert "pp2 ep1: nothing fits: the smallest peak is " in note and " MiB" in note  # a pair without a plan, named


def test_a_current_pipeline_with_ep_is_scored_on_the_ep_view(moe):
    """``--current "pp 2, ep 2"``: the current pipeline's mesh carries ep 2 and is priced as such (it was
    refused before); a degree a stage cannot hold is named."""
    from wrapopt.errors import OptionError
    from wrapopt.search.current import compare_current, parse_current

    sim = Simulator(moe, analytical_fabric(world_size=8), analytical_compute())
    request = ParallelRequest(mesh=MESH, ep="auto", pp="auto", train=TrainConfig())
    chosen = run_search(moe, sim, request, memory_budget=None, options=SearchOptions(trials=0)).result.best
    ep1, ep2 = (parse_current(text, moe, MESH) for text in ("pp 2", "pp 2, ep 2"))
    assert (ep1.plan.mesh.ep_size, ep2.plan.mesh.ep_size) == (1, 2) and ep2.plan.mesh.pp_size == 2
    one, two = (compare_current(moe, sim, c, chosen.plan, request=request, chosen_micro_batch=None,
                                chosen_estimate=chosen.estimate) for c in (ep1, ep2))
    assert two.current.estimate.step_s != one.current.estimate.step_s
    assert any("expert parallel 2" in n for n in two.current.estimate.notes)
    with pytest.raises(OptionError, match="ep 3"):  # a degree the stage's ranks cannot hold: named
        parse_current("pp 2, ep 3", moe, MESH)


def test_cp_with_ep_searches_each_cp_degree_s_view_over_the_ep_degrees(moe, capsys):
    """``--cp auto --ep auto`` (it was refused): each cp degree's view searched over the ep degrees
    (See [Note: cp with ep] in search/axes.py); a plan with both is priced on the ep view of a cp
    rank's share, exported with both degrees, and refused by wrapopt's own apply naming the export."""
    from wrapopt.errors import OptionError, PlanError
    from wrapopt.plan.ep import check_ep

    sim = Simulator(moe, analytical_fabric(world_size=8), analytical_compute())
    request = ParallelRequest(mesh=MESH, cp="auto", ep="auto")
    res = run_search(moe, sim, request, memory_budget=None, options=SearchOptions(trials=0)).result
    assert any(n.startswith("context parallel (tokens/s per GPU compared): ") for n in res.notes)
    assert any(n.startswith("expert parallel at the chosen cp degree: ") for n in res.notes)
    both = replace(res.best.plan, mesh=MESH.with_cp(2, 2))
    assert both.mesh.cp_size == 2 and both.mesh.ep_size == 2
    est = sim.simulate(both)
    view = sim.for_cp(2, 8)[0].for_ep(2)[0].simulate(replace(both, mesh=MESH))
    assert est.step_s == pytest.approx(view.step_s) and est.peak_bytes == view.peak_bytes
    assert any("expert parallel 2" in n for n in est.notes)
    assert est.step_s != sim.simulate(replace(both, mesh=MESH.with_cp(2))).step_s  # ep changes the cp plan's step
    data = _search(capsys, "--cp", "2", "--ep", "2", "--memory", "none")
    assert (data["mesh"]["cp_size"], data["mesh"]["ep_size"]) == (2, 2)
    assert cli(["search", "zoo:moe-tiny", "--world-size", "8", "--trials", "0", "--cp", "2", "--ep", "2", "--pp", "2",
                "--memory", "none"]) == 0  # in a pipeline too: [Note: ep in a pipeline] in search/shapes.py
    choice = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("wrapopt's choice: "))
    assert "pipeline of 2 ranks" in choice and "context parallel 2" in choice
    assert "expert parallel 2 (each mixture's experts split over 2 ranks, each expert sharded over 2" in choice
    model, _x = zoo.build("moe-tiny", "meta")
    with pytest.raises(PlanError, match=r"mesh.cp_size 2.*--to torchtitan"):
        check_ep(model, both)
    with pytest.raises(OptionError, match="searched per local batch only"):
        ParallelRequest(mesh=MESH, cp=2, ep=2, global_batch=16)
