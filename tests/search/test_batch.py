"""The global batch as the fixed quantity (search/batch.py): the splits, the error naming the
nearest global batches, the search choosing a split, the plan file recording it, estimate."""

from __future__ import annotations

import json

import pytest

from wrapopt.api import optimize_wrap, plan_model, prepare
from wrapopt.cli.main import main
from wrapopt.cost import Simulator
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.search.batch import BatchSplit, batch_scale, batch_splits, check_global_batch
from wrapopt.search.driver import SearchOptions
from wrapopt.spec import GlobalBatch, MeshSpec, ParallelRequest
from wrapopt.trace.meta import trace_model
from wrapopt.train import TrainConfig


def test_splits_are_every_divisor_per_degree():
    splits = batch_splits(GlobalBatch(16), {1: 4, 2: 2})
    assert [(s.tp_size, s.micro_batch, s.accumulation) for s in splits] == [
        (1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 8), (2, 2, 4), (2, 4, 2), (2, 8, 1)]
    assert all(s.global_batch == 16 for s in splits)
    assert batch_splits(GlobalBatch(12, micro_batch=3), {1: 4}) == (BatchSplit(1, 3, 1, 4),)
    assert batch_splits(GlobalBatch(12, accumulation=2), {1: 2}) == (BatchSplit(1, 3, 2, 2),)
    assert batch_splits(GlobalBatch(10), {1: 4}) == ()
    # tp2 alone when the global batch is a multiple of its 2 data-parallel ranks but not of 4
    assert {s.tp_size for s in batch_splits(GlobalBatch(10), {1: 4, 2: 2})} == {2}


@pytest.mark.parametrize("args, words", [
    ((10, {1: 4}), ["global batch 10", "multiple of 4", "8 and 12"]),
    ((3, {1: 8}), ["multiple of 8", "are 8"]),
    ((2049, {1: 1024, 8: 128}), ["128 or 1024", "2048 and 2176"]),
    ((8, {1: 2}, 2, 3), ["micro-batch 2, accumulation 3", "are 12"]),
])
def test_a_global_batch_with_no_split_names_the_nearest_that_work(args, words):
    with pytest.raises(ValueError) as e:
        check_global_batch(GlobalBatch(args[0], *args[2:]), args[1])
    assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ValueError, match="positive integer"):
        GlobalBatch(0)


def test_batch_scale_is_per_data_parallel_rank():
    assert batch_scale(8, 4) == 2.0 and batch_scale(16, 1, 8) == 2.0


def _setup(name: str, world: int, per_node: int):
    model, x = zoo.build(name, "meta")
    g = trace_model(model, x)
    fab = analytical_fabric(world_size=world, ranks_per_node=per_node)
    mesh = MeshSpec(world_size=world, ranks_per_node=per_node, shard_size=world)
    return model, g, fab, mesh


@pytest.mark.parametrize("name, world, per_node, n, tp", [("gpt-tiny", 2, 2, 16, 1), ("llama-7b", 64, 8, 256, 1),
                                                         ("llama-tiny", 8, 8, 32, "auto")])
def test_the_search_picks_a_feasible_split_and_the_plan_records_it(name, world, per_node, n, tp, tmp_path):
    model, g, fab, mesh = _setup(name, world, per_node)
    comp = analytical_compute()
    request = ParallelRequest(mesh=mesh, memory_budget=72 * 2**30, tp=tp, global_batch=n,
                              train=TrainConfig.preset("bf16"))
    plan, res = plan_model(prepare(request, model, graph=g, fabric=fab, compute=comp), search=SearchOptions(trials=0))
    dp = plan.mesh.dp_size
    assert plan.micro_batch * plan.accumulation * dp == n == plan.global_batch
    assert res.best.fits and res.best.estimate.peak_bytes <= 72 * 2**30
    chosen = [r for r in res.batch_rows if r.chosen]
    assert len(chosen) == 1 and chosen[0].split.micro_batch == plan.micro_batch
    # the chosen split is the fastest of the splits that were searched whole
    whole = [r.best.estimate.step_s for r in res.batch_rows if r.searched == "whole search"]
    assert res.best.estimate.step_s == min(whole)
    # its estimate is the split's: the plan's prediction at micro-batch x accumulation
    sim = Simulator(g, fab, comp, plan.train_config.sim_options(
        batch_scale=batch_scale(plan.micro_batch, g.batch_size, plan.mesh.tp_size)))
    assert sim.simulate(plan.spec).step_s == pytest.approx(res.best.estimate.step_s)
    plan.save(tmp_path / "p.json")
    back = WrapPlan.load(tmp_path / "p.json")
    assert (back.micro_batch, back.accumulation, back.global_batch) == (plan.micro_batch, plan.accumulation, n)
    assert back.train == plan.train and back.to_json()["train"] == plan.to_json()["train"]


def test_old_plan_files_without_a_micro_batch_still_load(tmp_path):
    model, g, fab, mesh = _setup("gpt-tiny", 2, 2)
    job = prepare(ParallelRequest(mesh=mesh, memory_budget="none"), model, graph=g, fabric=fab,
                  compute=analytical_compute())
    plan, _ = plan_model(job, search=SearchOptions(trials=0))
    data = plan.to_json()
    assert "micro_batch" not in data["train"]  # nothing new is written without a global batch
    assert WrapPlan.from_json(data).micro_batch is None and WrapPlan.from_json(data).accumulation == 1


def test_optimize_wrap_hands_back_the_micro_batch_and_accumulation():
    model, x = zoo.build("gpt-tiny", "meta")
    res = optimize_wrap(model, x, world_size=2, global_batch=16)
    assert res.micro_batch * res.accumulation * 2 == 16
    assert "global batch 16" in res.report() and "* micro-batch" in res.report()


def test_search_and_estimate_cli_with_a_global_batch(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["search", "zoo:gpt-tiny", "--world-size", "2", "--global-batch", "16", "--trials", "0",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "global batch 16 = micro-batch x accumulation" in text and "micro-batch 1 x 8 accumulation" in text
    train = json.loads(out.read_text())["train"]
    assert train["micro_batch"] * train["grad_accumulation"] * 2 == 16 == train["global_batch"]
    # --batch with --global-batch: that micro-batch, the accumulation follows
    assert main(["search", "zoo:gpt-tiny", "--world-size", "2", "--global-batch", "16", "--batch", "2",
                 "--trials", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["train"]["micro_batch"], data["train"]["grad_accumulation"]) == (2, 4)
    assert [r["micro_batch"] for r in data["search"]["batch"]] == [2]
    # estimate: the plan at every split, the fastest that fits reported
    assert main(["estimate", "zoo:gpt-tiny", "--world-size", "2", "--global-batch", "16", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["train"]["micro_batch"] * est["train"]["grad_accumulation"] * 2 == 16
    # a plan file that records its micro-batch is estimated at it
    assert main(["estimate", "zoo:gpt-tiny", "--plan", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["train"]["micro_batch"] == train["micro_batch"]
    # ... and with --global-batch, its split is chosen again
    assert main(["estimate", "zoo:gpt-tiny", "--plan", str(out), "--global-batch", "32", "--json"]) == 0
    other = json.loads(capsys.readouterr().out)["train"]
    assert other["micro_batch"] * other["grad_accumulation"] * 2 == 32 == other["global_batch"]
    # bad input: one line naming the nearest global batches
    assert main(["search", "zoo:gpt-tiny", "--world-size", "4", "--global-batch", "10", "--trials", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "8 and 12" in err


def test_each_split_searched_whole_gets_its_own_study_in_the_storage(tmp_path):
    optuna = pytest.importorskip("optuna")
    model, g, fab, mesh = _setup("gpt-tiny", 2, 2)
    path = tmp_path / "s.journal"
    job = prepare(ParallelRequest(mesh=mesh, memory_budget="none", global_batch=8), model, graph=g, fabric=fab,
                  compute=analytical_compute())
    plan_model(job, search=SearchOptions(trials=4, storage=str(path)))
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    names = sorted(s.study_name for s in optuna.get_all_study_summaries(JournalStorage(JournalFileBackend(str(path)))))
    assert len(names) == 2 and all("-mb" in n and "-acc" in n for n in names), names
