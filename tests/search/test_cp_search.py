"""The context-parallel search (search/cp.py): the degrees a request allows, each searched on its
view and compared per token, the answer lifted onto the cp mesh and stated as ``cp_size``."""

from __future__ import annotations

import json

import pytest

from wrapopt import zoo
from wrapopt.cli.main import main as cli
from wrapopt.job import prepare
from wrapopt.search.cp import resolve_cp
from wrapopt.search.driver import SearchOptions
from wrapopt.search.run import run_search
from wrapopt.spec import MeshSpec, ParallelRequest

MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


def _search(capsys, *flags: str) -> dict:
    rc = cli(["search", "zoo:llama-tiny", "--world-size", "8", "--trials", "0", *flags, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_auto_tries_the_degrees_that_split_the_sequence(llama_tiny):
    graph = llama_tiny[2]  # 64 tokens per sequence
    assert resolve_cp(graph, ParallelRequest(mesh=MESH, cp="auto")) == ((2, 4, 8), ())
    assert resolve_cp(graph, ParallelRequest(mesh=MESH, tp=2, cp="auto"))[0] == (2, 4)  # 4 data-parallel ranks
    assert resolve_cp(graph, ParallelRequest(mesh=MESH, cp=4)) == ((4,), ())
    assert resolve_cp(graph, ParallelRequest(mesh=MESH)) == ((), ())


def test_cp_auto_chooses_a_degree_that_fits_where_none_fits_without(capsys):
    """At a budget no plan without cp fits (its smallest peak: every block checkpointed), the search
    splits the sequence: the plan file states cp_size and its shard group holds whole cp groups."""
    data = _search(capsys, "--cp", "auto", "--memory", "6MiB")
    mesh, search = data["mesh"], data["search"]
    assert mesh["cp_size"] >= 2 and mesh["shard_size"] % mesh["cp_size"] == 0
    assert "cp" in mesh["axis_names"]
    assert data["prediction"]["peak_bytes"] <= 6 * 2**20
    rows = {r["row"]: r for r in search["tp_rows"]}
    assert any(label.startswith("best cp") for label in rows)
    assert all(r["cp_size"] == int(label.split("cp")[1].split()[0]) for label, r in rows.items()
               if label.startswith("best cp"))


def test_a_given_degree_lifts_every_plan_and_composes_with_tp(capsys):
    data = _search(capsys, "--cp", "2", "--tp", "2", "--memory", "none")
    mesh = data["mesh"]
    assert (mesh["cp_size"], mesh["tp_size"], mesh["axis_names"]) == (2, 2, ["shard", "cp", "tp"])
    assert mesh["shard_size"] % 2 == 0


# --- in a pipeline: See [Note: cp in a pipeline] in search/shapes.py ---------------------------------------


def test_cp_in_a_pipeline_at_a_global_batch_runs_its_sequences_and_compares_steps(llama_tiny, tmp_path, capsys):
    """``--pp auto --cp auto --global-batch 32`` (it was refused): every pipeline shape runs the 32
    sequences over the pipelines that read them (``dp / cp``), so the steps compare as they are; a
    pp x cp plan saved at the global batch reads back (``estimate``, ``--current``) as the search priced it."""
    graph = llama_tiny[2]
    assert resolve_cp(graph, ParallelRequest(mesh=MESH, cp=2, global_batch=8)) == ((2,), ())
    assert resolve_cp(graph, ParallelRequest(mesh=MESH, cp="auto", pp=2)) == ((2, 4), ())  # 4 ranks per stage
    assert resolve_cp(graph, ParallelRequest(mesh=MESH, cp="auto", pp=2, global_batch=16)) == ((2, 4), ())
    model, x = zoo.build("llama-tiny", "meta")
    job = prepare(ParallelRequest(mesh=MESH, pp="auto", cp="auto", global_batch=32, memory_budget="none"), model, x)
    res = run_search(job.graph, job.sim, job.request, memory_budget=None, options=SearchOptions(trials=0)).result
    note = next(n for n in res.notes if n.startswith("context parallel in the pipeline: "))
    assert "pp2 cp2: " in note and "x the step" in note and "per token" not in note and not res.pp_per_token
    path = str(tmp_path / "ppcp.json")
    data = _search(capsys, "--pp", "2", "--cp", "2", "--global-batch", "32", "--memory", "none", "--out", path)
    train, mesh = data["train"], data["mesh"]
    assert train["micro_batch"] * data["pipeline"]["microbatches"] * (8 // (2 * 2)) == 32  # 2 pipelines read
    assert cli(["estimate", "zoo:llama-tiny", "--world-size", "8", "--plan", path, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["step_s"] == pytest.approx(data["prediction"]["step_s"], rel=1e-9)
    assert (mesh["pp_size"], mesh["cp_size"]) == (2, 2)


def test_a_pipeline_of_cp_ranks_is_priced_on_the_cp_view(llama_tiny):
    """A pp x cp plan is the pipeline of one cp rank's share: its estimate is the cp view's of the
    same plan without the cp axis, and ring attention's exchanges make it more than half the step
    of the plan without cp (half the tokens per rank)."""
    from dataclasses import replace

    from wrapopt.cost.simulate import Simulator
    from wrapopt.hardware import analytical_compute, analytical_fabric
    from wrapopt.search.pipeline import _mesh, pipeline_plan
    from wrapopt.search.stages import pipeline_layout
    from wrapopt.spec import Shape

    graph = llama_tiny[2]
    sim = Simulator(graph, analytical_fabric(world_size=8), analytical_compute())
    layout = pipeline_layout(graph)
    plans = {c: pipeline_plan(layout, (3, 3), _mesh(MESH, Shape(pp=2, cp=c)), schedule="1F1B", microbatches=4,
                              reshard=True, checkpoint="none", tp_spec=None) for c in (1, 2)}
    assert plans[2].mesh.cp_size == 2 and plans[2].mesh.shard_size == 4  # dp_shard 2 x cp 2 per stage
    two, one = sim.simulate(plans[2]), sim.simulate(plans[1])
    view = sim.view(Shape(cp=2)).simulate(replace(plans[2], mesh=replace(plans[2].mesh, cp_size=1)))
    assert two.step_s == pytest.approx(view.step_s) and two.peak_bytes == view.peak_bytes
    assert 0.5 * one.step_s < two.step_s and two.peak_bytes < one.peak_bytes


def test_pp_with_cp_is_searched_and_compared_per_token(capsys):
    """``--pp 2 --cp 2``: the answer is a pipeline of cp ranks, its shard group ``dp_shard x cp``;
    under ``--cp auto`` every degree's best is in the notes, compared per token."""
    data = _search(capsys, "--pp", "2", "--cp", "2", "--memory", "none")
    mesh = data["mesh"]
    assert (mesh["pp_size"], mesh["cp_size"], mesh["shard_size"]) == (2, 2, 4)
    assert data["label"].endswith(" + cp2") or " + cp2 " in data["label"]
    model, x = zoo.build("llama-tiny", "meta")
    job = prepare(ParallelRequest(mesh=MESH, pp=2, cp="auto", memory_budget="none"), model, x)
    res = run_search(job.graph, job.sim, job.request, memory_budget=None, options=SearchOptions(trials=0)).result
    note = next(n for n in res.notes if n.startswith("context parallel in the pipeline (per token): "))
    assert all(f"pp2 cp{c}: " in note for c in (1, 2, 4)) and "its best" in note
    mine = res.best.plan.mesh.cp_size
    assert f"pp2 cp{mine}: its best" in note


def test_wrapopt_does_not_apply_cp_inside_a_pipeline(llama_tiny):
    from wrapopt.errors import PlanError
    from wrapopt.plan.pipeline import _check
    from wrapopt.search.pipeline import _mesh, pipeline_plan
    from wrapopt.search.stages import pipeline_layout
    from wrapopt.spec import Shape

    model, x, graph = llama_tiny
    plan = pipeline_plan(pipeline_layout(graph), (3, 3), _mesh(MESH, Shape(pp=2, cp=2)), schedule="1F1B",
                         microbatches=4, reshard=True, checkpoint="none", tp_spec=None)
    with pytest.raises(PlanError, match=r"mesh.cp_size 2: wrapopt does not apply context parallelism inside a "
                                        r"pipeline .*wrapopt export --to torchtitan"):
        _check(model, plan, None, (), (x,), lambda out, target: out.sum())


# --- at a fixed global batch: See [Note: context parallel at a global batch] in search/cp.py --------------


def test_a_fixed_global_batch_is_split_over_the_ranks_cp_leaves(capsys):
    """cp 2 on 8 ranks leaves 4 ranks that read different sequences: micro-batch x accumulation x 4 = 16."""
    data = _search(capsys, "--cp", "2", "--global-batch", "16", "--memory", "none")
    mesh, train = data["mesh"], data["train"]
    assert mesh["cp_size"] == 2 and mesh["shard_size"] % 2 == 0
    assert train["global_batch"] == 16 and train["micro_batch"] * train["grad_accumulation"] * 4 == 16
    rows = data["search"]["batch"]
    assert rows and all((r["dp_size"], r["cp_size"]) == (4, 2) for r in rows)
    assert all(r["label"].endswith("+ cp2") for r in rows if "label" in r)


def test_cp_auto_at_a_global_batch_compares_the_steps(capsys):
    """Every degree's step covers the same 8 sequences: the rows are compared by the step itself, the
    answer is the smallest degree within the error of the fastest, and each row is a plan of its degree
    at its own split."""
    from wrapopt.search.choose import STEP_ERROR

    rc = cli(["search", "zoo:llama-tiny", "--world-size", "8", "--trials", "0", "--cp", "auto", "--global-batch", "8",
              "--memory", "4MiB"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "context parallel at the global batch of 8 sequences (steps compared): cp 1:" in out
    assert "context parallelism (the same global batch; steps compared;" in out
    data = _search(capsys, "--cp", "auto", "--global-batch", "8", "--memory", "4MiB")
    rows = {r["row"]: r for r in data["search"]["tp_rows"]}
    degrees = {1 if label.startswith("best without") else int(label.split("cp")[1].split()[0]): r
               for label, r in rows.items()}
    assert set(degrees) == {1, 2, 4, 8} and all(r["cp_size"] == c for c, r in degrees.items())
    for c, r in degrees.items():
        assert f"{8 // c} ranks" in r["row"]  # micro-batch x accumulation x the ranks cp leaves: 8 sequences
    chosen, fitting = data["mesh"].get("cp_size", 1), [r["step_s"] for r in degrees.values() if r["fits"]]
    assert degrees[chosen]["step_s"] <= min(fitting) * (1 + STEP_ERROR)
    assert all(degrees[c]["step_s"] > min(fitting) * (1 + STEP_ERROR) for c in degrees if c < chosen)


def test_a_global_batch_no_cp_degree_can_split_is_one_line(capsys):
    assert cli(["search", "zoo:llama-tiny", "--world-size", "8", "--trials", "0", "--cp", "2",
                "--global-batch", "6"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "global batch 6 has no split" in err[0]
    assert "4 ranks that read different sequences" in err[0]
    assert "the nearest that work are 4 and 8" in err[0]


def test_estimate_splits_a_cp_plans_global_batch_over_the_ranks_that_read_sequences(capsys, tmp_path):
    assert cli(["estimate", "zoo:llama-tiny", "--plan", "per-block", "--world-size", "8", "--cp", "2",
                "--global-batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 4 x 1 accumulation (4 dp ranks, cp2)" in out
    path = str(tmp_path / "cp.json")  # a cp plan saved at a global batch reads back (its check counted dp x cp)
    data = _search(capsys, "--cp", "2", "--global-batch", "16", "--memory", "none", "--out", path)
    assert cli(["estimate", "zoo:llama-tiny", "--world-size", "8", "--plan", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_s"] == pytest.approx(data["prediction"]["step_s"], rel=1e-9)
    assert cli(["estimate", "zoo:llama-tiny", "--plan", "per-block", "--world-size", "8", "--cp", "2",
                "--global-batch", "6"]) == 1
    assert "4 data-parallel ranks under context parallelism of 2" in capsys.readouterr().err


def test_estimate_keeps_the_cp_and_ep_degrees_on_the_pipeline_it_builds(capsys):
    """``estimate --pp 2 --cp 2`` (``--ep 2``): the pipeline is cut from the cp (ep) rank's share, as the
    search prices it; it dropped the axis before."""
    for model, axis in (("zoo:llama-tiny", "cp"), ("zoo:moe-tiny", "ep")):
        assert cli(["estimate", model, "--plan", "per-block", "--world-size", "8", "--pp", "2", f"--{axis}", "2"]) == 0
        plan_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("model: "))
        assert " + pp2 " in plan_line and f" + {axis}2 " in plan_line, plan_line


def test_current_at_another_cp_degree_names_the_degree_as_a_choice(capsys):
    data = _search(capsys, "--cp", "auto", "--memory", "6MiB", "--current", "per-block, full AC, cp 4")
    assert data["mesh"]["cp_size"] == 2
    cmp = data["search"]["current"]
    gain = next(g for g in cmp["choices"] if g["dimension"] == "context parallel")
    assert (gain["current"], gain["wrapopt"]) == ("cp4", "cp2")
    assert gain["alone"]["tokens_per_s_per_gpu_ratio"] > 1  # cp 4: the same FSDP bytes for half the tokens


def test_a_current_pipeline_of_cp_ranks_counts_the_pipelines_that_read_sequences(capsys):
    """``--current "pp 2, cp 2"`` at a global batch of 16 on 8 ranks: 4 data-parallel ranks a stage,
    2 cp groups of them read sequences, so 8 micro-batches of 1 on each of 2 pipelines (it was refused)."""
    data = _search(capsys, "--pp", "2", "--global-batch", "16", "--memory", "none", "--current", "pp 2, cp 2")
    cur = data["search"]["current"]["current"]
    assert (cur["micro_batch"], cur["accumulation"]) == (1, 8) and cur["label"] == "current: pp 2, cp 2"
    ratio = data["search"]["current"]["speedup"]
    assert ratio > 0 and ratio == pytest.approx(cur["step_s"] / data["search"]["current"]["wrapopt"]["step_s"],
                                                rel=1e-9)  # the same 16 sequences: the steps compare


def test_optimize_wrap_takes_a_cp_degree(llama_tiny, monkeypatch):
    import wrapopt.api
    from wrapopt import optimize_wrap

    monkeypatch.setattr(wrapopt.api, "DEFAULT_TRIALS", 0)  # the DP and the baselines, not the study: seconds
    model, x, _graph = llama_tiny
    res = optimize_wrap(model, x, world_size=8, cp=2, memory_budget="none")  # no process group: plans only
    assert res.plan.mesh.cp_size == 2 and res.plan.mesh.shard_size % 2 == 0
