"""A fixed global batch with the pipeline axis ([Note: pipeline global batch]): the micro-batch
count and size split the global batch, every row is priced at it, a degree that cannot run it
is dropped with the reason, and a global batch no degree runs is refused naming what works."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from wrapopt.cli.main import main
from wrapopt.cost.pipeline import stage_options
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import OptionError
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.report.batch import format_batch
from wrapopt.search.batch import BatchRow, BatchSplit, recorded_scale
from wrapopt.search.driver import SearchOptions
from wrapopt.search.run import run_search
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.trace.meta import trace_model
from wrapopt.train import TrainConfig

WORLD = 4


@pytest.fixture(scope="module")
def llama():
    model, x = zoo.build("llama-tiny", "meta")
    g = trace_model(model, x)
    return g, Simulator(g, analytical_fabric(world_size=WORLD, ranks_per_node=WORLD), analytical_compute())


def _search(llama, global_batch, pp="2", train=None):
    g, sim = llama
    mesh = MeshSpec(world_size=WORLD, ranks_per_node=WORLD, shard_size=WORLD)
    request = ParallelRequest(mesh=mesh, train=train or TrainConfig(), pp=pp, global_batch=global_batch)
    return run_search(g, sim, request, memory_budget=None, options=SearchOptions(trials=0))


def test_pp_2_splits_the_global_batch_into_its_micro_batches(llama):
    g, _ = llama
    found = _search(llama, 16)
    plan, train = found.result.best.plan, found.train
    assert plan.mesh.pp_size == 2 and plan.pipeline is not None
    m, dp = plan.pipeline.microbatches, plan.mesh.dp_size
    assert dp == 2 and train.global_batch == 16 and train.grad_accumulation == 1
    assert m * train.micro_batch * dp == 16
    # the stage simulators price a micro-batch of that many sequences (the traced batch is 4)
    assert g.batch_size == 4
    assert stage_options(found.sim.options, 2, m).batch_scale * g.batch_size == pytest.approx(train.micro_batch)
    # the recorded micro-batch gives the search's simulator back (a plan file re-scored)
    assert recorded_scale(g, train, plan) == pytest.approx(found.sim.options.batch_scale)
    assert found.sim.simulate(plan) == found.result.best.estimate


def test_every_pipeline_row_is_at_the_same_global_batch(llama):
    g, sim = llama
    found = _search(llama, 32, pp="auto")
    rows = dict(found.result.pp_rows)
    assert {"best pp1 (no pipeline)", "best pp2", "best pp4"} <= set(rows)
    assert found.train.global_batch == 32
    for label, s in rows.items():
        if s.plan.pipeline is None:
            continue
        mb = 32 // (s.plan.mesh.dp_size * s.plan.pipeline.microbatches)
        assert mb * s.plan.mesh.dp_size * s.plan.pipeline.microbatches == 32, label
        train = TrainConfig(micro_batch=mb, global_batch=32)
        again = Simulator(g, sim.fabric, sim.compute, train.sim_options(batch_scale=recorded_scale(g, train, s.plan)))
        assert again.simulate(s.plan).step_s == pytest.approx(s.estimate.step_s), label
    # degree 1 is today's global-batch search: its row is the one without --pp
    alone = _search(llama, 32, pp=None)
    assert rows["best pp1 (no pipeline)"].estimate == alone.result.best.estimate
    assert alone.train.global_batch == 32 and alone.result.batch_rows


def test_a_larger_global_batch_takes_longer_per_step(llama):
    small, large = (_search(llama, n).result.best.estimate.step_s for n in (8, 64))
    assert small < large < 8 * small  # more sequences per step, fewer seconds per sequence


def test_a_degree_that_cannot_run_the_global_batch_is_dropped(llama):
    # --accumulation 2 fixes two micro-batches per step: a pipeline of 4 stages cannot take them
    found = _search(llama, 16, pp="auto", train=TrainConfig(grad_accumulation=2))
    tried = dict(found.result.pp_tried)
    assert "dropped" in tried[4] and "--accumulation 2 is not a multiple of 4" in tried[4]
    pp2 = dict(found.result.pp_rows)["best pp2"].plan
    assert pp2.pipeline.microbatches == 2


def test_a_global_batch_no_degree_can_run_is_refused(llama):
    with pytest.raises(OptionError, match=r"--global-batch 6: no degree can run it .*pp2: tp1: dropped.*"
                                          r"global batches that work: 4 and 8"):
        _search(llama, 6)
    with pytest.raises(OptionError, match=r"--global-batch 3: .*pp1: dropped.*pp4: .*work: 4$"):
        _search(llama, 3, pp="auto")


def test_cli_search_global_batch_with_pp(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", "zoo:llama-tiny", "--world-size", "4", "--pp", "2", "--global-batch", "16",
                 "--trials", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pipeline degrees (every row at the same global batch)" in text and "best pp2" in text
    assert "pipeline micro-batches of" in text and "(global batch 16)" in text
    plan = WrapPlan.load(str(out))
    pipe = plan.spec.pipeline
    assert pipe is not None and plan.micro_batch * pipe.microbatches * plan.mesh.dp_size == 16
    assert json.loads(out.read_text())["train"]["global_batch"] == 16
    assert main(["search", "zoo:llama-tiny", "--world-size", "4", "--pp", "2", "--global-batch", "6",
                 "--trials", "0"]) == 1
    assert "--global-batch 6" in capsys.readouterr().err
    # the plan file, estimated again, is scored at its recorded micro-batch: the search's figures
    assert main(["estimate", "zoo:llama-tiny", "--plan", str(out), "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["step_s"] == pytest.approx(plan.prediction["step_s"])
    assert main(["estimate", "zoo:llama-tiny", "--plan", str(out), "--global-batch", "6"]) == 1
    err = capsys.readouterr().err
    assert "--global-batch 6: the plan runs 2 micro-batches on each of its 2 pipelines: it needs a multiple of 4" in err


def test_cli_estimate_global_batch_with_pp(capsys):
    assert main(["estimate", "zoo:llama-tiny", "--world-size", "4", "--pp", "2", "--global-batch", "16",
                 "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["mesh"]["pp_size"] == 2 and est["train"]["global_batch"] == 16
    assert "pipeline micro-batches of" in est["training"]
    assert est["tokens_per_s_per_gpu"] == pytest.approx(16 * 64 / (est["step_s"] * WORLD), rel=1e-3)


def test_the_splits_table_without_a_chosen_split_names_the_global_batch():
    rows = (BatchRow(BatchSplit(1, 2, 1, 4), None, "skipped: nothing fits"),)
    text = format_batch(SimpleNamespace(batch_rows=rows))  # a pipeline plan won: no split of degree 1 chosen
    assert text.startswith("global batch 8 =") and "none chosen: a pipeline plan is faster" in text
