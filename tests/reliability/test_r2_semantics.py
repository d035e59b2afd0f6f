"""Issue #51, what `--current` and `estimate` mean: the sync mode a plain FSDP2 loop runs, the
plan's own batch split, contradictory descriptions, flags that used to be ignored, the
checkpointing modes asked for, huge global batches and CPU offload on a 70B-sized trace."""

from __future__ import annotations

import json
import re
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

from tests.reliability.common import run_cli
from wrapopt.choices import CURRENT_FORMS
from wrapopt.cli.main import main
from wrapopt.errors import InfeasibleError, OptionError, PlanError
from wrapopt.job import prepare
from wrapopt.search.baselines import smallest_plan
from wrapopt.search.batch import batch_splits, divisors, score_splits
from wrapopt.search.current import compare_current, parse_current
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.search.given import given_spec
from wrapopt.search.pipeline_batch import MAX_MICROBATCHES, PipelineBatch
from wrapopt.spec import GlobalBatch, MeshSpec, ParallelRequest, Shape
from wrapopt.train import TrainConfig

MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


def llama70b_slice():
    """Four blocks of Llama-2 70B's shapes (d 8192, FFN 28672, 64 heads, 8 KV heads), 4096 tokens,
    on meta: a 70B-sized trace in seconds (a CLI MODEL: tests.reliability.test_r2_semantics:llama70b_slice)."""
    from wrapopt.models import zoo

    with torch.device("meta"):
        model = zoo.Llama(vocab=32000, dim=8192, n_layers=4, n_heads=64, n_kv_heads=8, ffn=28672)
    return model, (torch.zeros(1, 4096, dtype=torch.long),)


# -- huge global batches: divisors, not a scan ----------------------------------------------------

def test_divisors_are_every_divisor():
    for n in range(1, 400):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_a_global_batch_of_10_to_the_12_splits_in_no_time():
    start = time.perf_counter()
    splits = batch_splits(GlobalBatch(10**12), {1: 8, 2: 4})
    assert time.perf_counter() - start < 1.0
    # 10**12 / 8 = 2**9 x 5**12 (130 divisors); 10**12 / 4 = 2**10 x 5**12 (143)
    assert len(splits) == 130 + 143
    assert all(s.global_batch == 10**12 for s in splits)
    fixed = batch_splits(GlobalBatch(10**12, micro_batch=5), {1: 8})
    assert [(s.micro_batch, s.accumulation) for s in fixed] == [(5, 10**12 // 40)]


def test_estimate_at_a_huge_global_batch_answers(llama_tiny):
    """Splits past int64 byte counts are skipped, not a traceback; larger micro-batches stop at the budget."""
    model, inputs, graph = llama_tiny
    warnings.simplefilter("error")  # no fall-back of the compiled step loop on an overflow
    for budget in ("none", "1GiB"):
        request = ParallelRequest(mesh=MESH, global_batch=10**15, memory_budget=budget, train=TrainConfig())
        job = prepare(request, model, inputs, graph=graph)
        plan = smallest_plan(graph, MESH)
        split, _sim, rows = score_splits(graph, job.sim, plan, request, memory_budget=job.budget)
        assert split.global_batch == 10**15 and len(rows) == len(divisors(10**15 // 8))
        skipped = [r for r in rows if r.best is None]
        assert skipped and all(r.split.micro_batch > split.micro_batch for r in skipped)


def test_a_huge_global_batch_on_a_pipeline_tries_bounded_counts():
    """N / dp micro-batches of one sequence (1.25 x 10**11 here) are not priced: the schedule's order would not end."""
    fixed = PipelineBatch(global_batch=10**12, world_size=8, sim=None)
    counts, why = fixed.counts(Shape(pp=2))
    assert counts and why == "" and max(counts) <= MAX_MICROBATCHES and counts == (2, 4, 8, 16)
    one = PipelineBatch(global_batch=10**12, world_size=8, sim=None, micro_batch=1)
    counts, why = one.counts(Shape(pp=2))
    assert counts == () and f"more than the {MAX_MICROBATCHES}" in why and "--batch" in why


# -- --current: one item per field, every documented form ------------------------------------------

@pytest.mark.parametrize("text, first, second", [
    ("per-block, full AC, no AC", "full AC", "no AC"),
    ("reshard, no reshard", "reshard", "no reshard"),
    ("per-block, every-leaf", "per-block", "every-leaf"),
    ("tp 2, tp 4", "tp 2", "tp 4"),
    ("tp 2, sp, no sp", "sp", "no sp"),
    ("sync every, no sync", "sync every", "no sync"),
    ("micro-batch 2, mbs 4", "micro-batch 2", "mbs 4"),
])
def test_contradictory_items_are_refused_naming_both(llama_tiny, text, first, second):
    _model, _inputs, graph = llama_tiny
    with pytest.raises(OptionError) as info:
        parse_current(text, graph, MESH)
    msg = str(info.value)
    assert "\n" not in msg and f"{first!r} and {second!r} contradict" in msg


@pytest.mark.parametrize("text", ["", "   ", ",", " , ;"])
def test_a_description_without_items_is_refused(llama_tiny, text):
    _model, _inputs, graph = llama_tiny
    with pytest.raises(OptionError, match="nothing given|no item"):
        parse_current(text, graph, MESH)


def test_the_same_item_twice_is_one_statement(llama_tiny):
    _model, _inputs, graph = llama_tiny
    cur = parse_current("full AC, ckpt, micro-batch 2, mbs 2", graph, MESH)
    assert cur.micro_batch == 2 and all(u.checkpoint is True for u in cur.plan.units if not u.is_root)


# Every form CURRENT_FORMS (the error's list), the README and docs/design.md name.
DOCUMENTED = ["per-block", "every-leaf", "every_leaf", "Every Leaf", "per block", "size-1e8", "root-only", "no-shard",
              "no AC", "full AC", "selective AC",
              "AC every 2", "micro-batch 2", "reshard", "no reshard", "sync every", "sync last", "no sync",
              "shard 4", "tp 2", "tp 2, sequence parallel, async TP", "tp 2, no sequence parallel",
              "tp 2, no loss parallel",
              "local batch 4", "pp 2", "pp 2, 1F1B", "pp 2, Interleaved1F1B, 2 stages per rank",
              "pp 2, GPipe, micro-batch 2", "per-block, full AC, micro-batch 2",
              "per-block, full AC, local batch 16, tp 2", "per-block, full AC, local batch 32, tp 2, pp 2, "
              "Interleaved1F1B"]


@pytest.mark.parametrize("text", DOCUMENTED)
def test_every_documented_form_parses(llama_tiny, text):
    _model, _inputs, graph = llama_tiny
    cur = parse_current(text, graph, MESH)
    assert cur.plan.units and cur.text == text


def test_the_documented_list_names_the_forms_tested():
    for word in ("per-block", "every-leaf", "size-1e8", "no AC", "full AC", "selective AC", "micro-batch N",
                 "no reshard", "sync last", "shard N", "tp N", "local batch N", "pp N", "Interleaved1F1B"):
        assert word in CURRENT_FORMS, word


def test_cli_refuses_an_empty_current(capsys):
    code, err = run_cli(["search", "zoo:gpt-tiny", "--world-size", "2", "--trials", "0", "--current", ""], capsys)
    assert code == 1 and "--current '': nothing given" in err and "Traceback" not in err


# -- --current: a plain FSDP2 loop syncs every micro-batch -----------------------------------------

def test_current_is_scored_syncing_every_micro_batch_unless_told(llama_tiny):
    model, inputs, graph = llama_tiny
    request = ParallelRequest(mesh=MESH, global_batch=64, memory_budget="none", train=TrainConfig())
    job = prepare(request, model, inputs, graph=graph)
    chosen = search_plan(graph, job.sim, MESH, options=SearchOptions(trials=0)).best.plan

    def modes(text: str, req: ParallelRequest = request) -> tuple[str, str]:
        cur = parse_current(text, graph, MESH)
        c = compare_current(graph, job.sim, cur, chosen, request=req, chosen_micro_batch=2)
        assert c.current.accumulation == 4  # 2 x 4 x 8 = 64
        return c.current.estimate.accumulation_sync, c.chosen.estimate.accumulation_sync

    assert modes("per-block, micro-batch 2") == ("every", "last")  # the search's own: the faster that fits
    assert modes("per-block, micro-batch 2, no sync")[0] == "last"
    told = ParallelRequest(mesh=MESH, global_batch=64, memory_budget="none",
                           train=TrainConfig(accumulation_sync="last"))
    assert modes("per-block, micro-batch 2", told)[0] == "last"
    cur = parse_current("per-block, micro-batch 2", graph, MESH)
    gains = compare_current(graph, job.sim, cur, chosen, request=request, chosen_micro_batch=2).gains
    sync = [g for g in gains if g.dimension == "gradient sync"]
    assert sync and sync[0].alone.estimate.accumulation_sync == "last"


# -- estimate: the plan's own split, sync every, flags that conflict --------------------------------

@pytest.fixture(scope="module")
def plan_512(tmp_path_factory):
    """A plan written by search --global-batch 64 --batch 4 --precision bf16 (gpt-tiny on 2 ranks: 4 x 8 x 2)."""
    path = str(tmp_path_factory.mktemp("r2") / "p64.json")
    assert main(["search", "zoo:gpt-tiny", "--world-size", "2", "--global-batch", "64", "--batch", "4", "--precision",
                 "bf16", "--trials", "0", "--memory", "none", "--out", path]) == 0
    with open(path) as f:
        return path, json.load(f)["train"]


def _estimate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["estimate", "zoo:gpt-tiny", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_keeps_the_plans_split_at_its_global_batch(plan_512, capsys):
    path, recorded = plan_512
    assert recorded["grad_accumulation"] > 1  # the case of the issue (8 in the plan, 1 given)
    out = _estimate(["--plan", path, "--global-batch", "64", "--precision", "bf16"], capsys)
    train = out["train"]
    assert (train["micro_batch"], train["grad_accumulation"], train["global_batch"]) == (
        recorded["micro_batch"], recorded["grad_accumulation"], 64)
    notes = " ".join(out["notes"])
    assert "another training step" not in notes and "the plan's: scored at its own split" in notes
    # --precision alone keeps the plan's split too
    alone = _estimate(["--plan", path, "--precision", "bf16"], capsys)["train"]
    assert alone["grad_accumulation"] == recorded["grad_accumulation"]


def test_estimate_syncs_every_micro_batch_unless_told(capsys):
    base = ["--plan", "per-block", "--world-size", "2", "--accumulation", "4", "--memory", "none"]
    assert _estimate(base, capsys)["train"]["accumulation_sync"] == "every"
    assert _estimate([*base, "--sync", "last"], capsys)["train"]["accumulation_sync"] == "last"


def test_sync_at_one_micro_batch_gets_a_note(capsys):
    out = _estimate(["--plan", "per-block", "--world-size", "2", "--sync", "last"], capsys)
    assert any("--sync last changes nothing" in n for n in out["notes"])


def test_a_pipeline_plan_file_refuses_another_pp(llama_tiny):
    _model, _inputs, graph = llama_tiny
    piped = parse_current("pp 2", graph, MESH).plan
    given = SimpleNamespace(spec=piped, source="pp2.json")
    with pytest.raises(PlanError) as info:
        given_spec(given, graph, MESH, None, request=ParallelRequest(mesh=MESH, pp=4))
    msg = str(info.value)
    assert "pp2.json" in msg and "degree 2" in msg and "--pp says 4" in msg and "\n" not in msg
    assert given_spec(given, graph, MESH, None, request=ParallelRequest(mesh=MESH, pp=2)) is not None


def test_pp_auto_on_an_encoder_decoder_says_why(capsys):
    assert main(["search", "zoo:t5-tiny", "--world-size", "2", "--pp", "auto", "--trials", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"notes: --pp auto: pipelining not tried: .*block chains", out)


# -- --checkpoint-modes binds the answer -----------------------------------------------------------

def test_checkpoint_modes_none_never_returns_a_checkpointing_plan(llama_tiny):
    model, inputs, graph = llama_tiny
    job = prepare(ParallelRequest(mesh=MESH, memory_budget="none"), model, inputs, graph=graph)
    tight = 1.2 * job.sim.simulate(smallest_plan(graph, MESH)).peak_bytes
    free = search_plan(graph, job.sim, MESH, memory_budget=tight, options=SearchOptions(trials=0))
    assert any(u.checkpoint for u in free.best.plan.units)  # the case: only checkpointing fits
    with pytest.raises(InfeasibleError) as info:
        search_plan(graph, job.sim, MESH, memory_budget=tight,
                    options=SearchOptions(trials=0, checkpoint_modes=(False,)))
    msg = str(info.value)
    assert "Only --checkpoint-modes none was searched" in msg and "add full to --checkpoint-modes" in msg
    roomy = search_plan(graph, job.sim, MESH, options=SearchOptions(trials=0, checkpoint_modes=(False,)))
    assert not any(u.checkpoint for s in (roomy.best, *roomy.pareto) for u in s.plan.units)


# -- CPU offload on a 70B-sized trace: search, sync comparison, --current, estimate of the plan ------

def test_offload_on_a_70b_sized_trace_end_to_end(tmp_path, capsys):
    model = "tests.reliability.test_r2_semantics:llama70b_slice"
    path = str(tmp_path / "off.json")
    assert main(["search", model, "--world-size", "8", "--gpu", "h100-sxm", "--global-batch", "16", "--trials", "0",
                 "--memory", "20GiB", "--offload", "--host-memory", "2TB", "--current", "per-block, AC every 2",
                 "--out", path]) == 0
    out = capsys.readouterr().out
    assert "CPU offload chosen" in out and "wrapopt's choice scored both ways" in out
    assert "offload: none -> CPU offload" in out  # offload is its own choice beside --current
    with open(path) as f:
        written = json.load(f)
    assert written["offload"] is True and written["train"]["grad_accumulation"] > 1
    step = [float(m) for m in re.findall(r"\* every micro-batch\s+([\d.]+)ms", out)]
    # the plan file, estimated with no --host-memory: priced on the stated GPU's host, the search's step
    est = _estimate_model(model, ["--plan", path, "--gpu", "h100-sxm"], capsys)
    assert est["step_s"] * 1e3 == pytest.approx(step[0], abs=0.01)


def _estimate_model(model: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["estimate", model, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_search_notes_a_sync_that_changes_nothing(capsys):
    assert main(["search", "zoo:gpt-tiny", "--world-size", "2", "--trials", "0", "--sync", "last"]) == 0
    assert "note: --sync last changes nothing here" in capsys.readouterr().out
    assert main(["search", "zoo:gpt-tiny", "--world-size", "2", "--trials", "0", "--sync", "last",
                 "--accumulation", "2"]) == 0
    assert "changes nothing" not in capsys.readouterr().out


def test_current_plan_file_keeps_the_sync_mode_it_records(plan_512, gpt_tiny):
    from wrapopt.plan.file import current_plan_loader

    path, recorded = plan_512
    model, _, graph = gpt_tiny
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    spec, micro_batch, sync = current_plan_loader(model, graph, mesh)(path)
    assert micro_batch == recorded["micro_batch"] and sync == recorded["accumulation_sync"]
    assert parse_current(path, graph, mesh, load_plan=current_plan_loader(model, graph, mesh)).sync == sync


def test_estimate_at_another_global_batch_says_it_splits_again(plan_512, capsys):
    path, recorded = plan_512
    notes = " ".join(_estimate(["--plan", path, "--global-batch", "128", "--precision", "bf16"], capsys)["notes"])
    assert f"global_batch ({recorded['global_batch']} in the plan, 128 given: split again)" in notes
    assert "grad_accumulation (" not in notes and "1 given" not in notes
