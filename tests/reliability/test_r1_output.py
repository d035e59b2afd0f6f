"""Issue #51, "one answer per command": ``search`` prints throughput and MFU beside each step,
MFU counts the experts a token uses, every row states its gradient sync mode under
accumulation, the "why" line names the plan it follows, and the batch reads in sequences per
data-parallel rank."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch.nn as nn

from tests.search.common import zoo_graph
from wrapopt import zoo
from wrapopt.assumptions import Assumptions
from wrapopt.cli.main import main
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.report.choice import choice_why, format_report
from wrapopt.report.estimate import infer_model_flops, step_work
from wrapopt.search.baselines import baselines, make_plan
from wrapopt.search.choose import MEMORY_ERROR, STEP_ERROR, choose
from wrapopt.search.driver import SearchResult
from wrapopt.search.strategy import Scored
from wrapopt.spec import CostEstimate, MeshSpec
from wrapopt.trace.meta import trace_model

GiB = 2**30
MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _est(step_s: float, peak: float, sync: str | None = None) -> CostEstimate:
    return CostEstimate(step_s=step_s, fwd_s=0.0, bwd_s=0.0, compute_s=0.0, comm_s=0.0, exposed_comm_s=0.0,
                        peak_bytes=int(peak), peak_breakdown=(), units=(), accumulation_sync=sync)


# -- search prints tokens/s/GPU and MFU beside each step, by estimate's computation ----------------------------

SEARCH = ["search", "zoo:gpt-tiny", "--world-size", "8", "--gpu", "h100-sxm", "--accumulation", "4", "--trials", "0"]


def test_search_rows_carry_throughput_and_mfu_as_estimate_computes_them(capsys):
    text = _cli(SEARCH, capsys)
    found = json.loads(_cli([*SEARCH, "--json"], capsys))
    rates = found["search"]["rates"]
    est = json.loads(_cli(["estimate", "zoo:gpt-tiny", "--plan", "per-block", "--world-size", "8", "--gpu",
                           "h100-sxm", "--accumulation", "4", "--json"], capsys))
    head = next(line for line in text.splitlines() if "pred step" in line)
    assert "tok/s/GPU" in head and "MFU" in head
    rows = {m.group(1): m for m in re.finditer(r"^[* ] (\S+)\s+\d+\s+([\d.]+)ms\s+([\d,]+)\s+([\d.]+)%", text, re.M)}
    assert {"per-block", "per-block,ckpt", "no-shard"} <= set(rows) <= set(rates["rows"]) | {found["label"]}
    for label, m in rows.items():
        r = rates["rows"].get(label) or rates["rows"]["wrapopt"]
        step_s = float(m.group(2)) / 1e3
        assert int(m.group(3).replace(",", "")) == pytest.approx(r["tokens_per_s_per_gpu"], rel=1e-3)
        assert float(m.group(4)) == pytest.approx(100 * r["mfu"], abs=0.051)
        # one step's work (tokens, FLOPs) is the row's rate x its step: the same for every row and for estimate
        assert r["tokens_per_s_per_gpu"] * step_s == pytest.approx(est["tokens_per_s_per_gpu"] * est["step_s"],
                                                                   rel=5e-3)
        assert r["mfu"] * step_s == pytest.approx(est["mfu"] * est["step_s"], rel=5e-3)
    assert rates["peak_source"] == est["peak_source"] and rates["flops_formula"] == est["flops_formula"]
    assert f"{est['peak_flops_per_s'] / 1e12:,.1f} TFLOP/s ({est['peak_source']})" in text


def test_a_measured_cpu_device_states_what_mfu_is_against():
    """No stated GPU (a measured CPU): MFU is against the measured matmul rate, and the legend
    under the table says so, not a datasheet's peak."""
    from wrapopt.hardware.profiles import ComputeProfile

    cpu = ComputeProfile(kind="measured", device="cpu", runs_ahead=False, flops_per_s=5e10,
                         memory_bandwidth_bytes_per_s=1e10, unit_overhead_s=1e-3)
    model, inputs = zoo.build("gpt-tiny", "meta")
    graph = trace_model(model, inputs)
    work = step_work(model, inputs, graph, cpu, accumulation=2, batch_scale=1.0, compute_dtype="float32")
    assert work.peak_flops_per_s == 5e10 and work.peak_source == "the measured matmul rate"
    assert work.mfu(0.5) == pytest.approx(work.flops.flops * 2 / 0.5 / 5e10)
    rows = [Scored(baselines(graph, MESH)["per-block"], _est(0.5, GiB), True)]
    text = format_report(_result(rows), analytical_fabric(world_size=2), cpu, MESH, work=work)
    legend = next(line for line in text.splitlines() if "MFU against" in line)
    assert "50.0 TFLOP/s" not in legend and "0.1 TFLOP/s (the measured matmul rate)" in legend
    assert f"{work.mfu(0.5) * 100:5.1f}%" in next(line for line in text.splitlines() if line.startswith("* "))


# -- MFU counts active parameters ------------------------------------------------------------------------------

def _stacked(model: nn.Module, graph) -> tuple[int, int]:
    """The stacked expert weights and the expert count."""
    mods = [m for m in graph.modules if m.experts]
    assert mods
    n = mods[0].experts
    return sum(p.numel() for m in mods for p in model.get_submodule(m.fqn).parameters(recurse=False)
               if p.shape[0] == n), n


def _non_embedding(model: nn.Module) -> int:
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in emb)


def test_moe_mfu_counts_the_routed_experts_of_a_mixtral_config(tmp_path):
    pytest.importorskip("transformers")
    from tests.models.hf_configs import write_config
    from wrapopt.models.sources import resolve_model

    src = resolve_model(f"hf:{write_config('mixtral', str(tmp_path))}", batch=2, seq=16)
    model = src.build("meta")
    graph = trace_model(model, src.inputs)
    k = model.config.num_experts_per_tok
    stacked, n = _stacked(model, graph)
    flops = infer_model_flops(model, src.inputs, graph)
    active = _non_embedding(model) - stacked + stacked * k // n
    assert f"N = {active:,} active parameters" in flops.formula and f"top-{k} of {n}" in flops.formula
    # the trace prices top-k (See [Note: experts on meta]); MFU's FLOPs now agree with it, where counting
    # every expert would not
    traced = 3 * sum(m.fwd_flops for m in graph.modules)
    assert flops.flops == pytest.approx(traced, rel=0.05)
    every = flops.flops + 6 * (stacked - stacked * k // n) * flops.tokens
    assert every > 1.2 * traced


def test_moe_mfu_reads_top_k_off_the_router_module():
    model, inputs = zoo.build("moe-tiny", "meta")
    graph = trace_model(model, inputs, loss_fn=zoo.ZOO["moe-tiny"].loss)
    stacked, n = _stacked(model, graph)
    flops = infer_model_flops(model, inputs, graph)
    k = next(m.top_k for m in model.modules() if hasattr(m, "top_k"))
    assert f"N = {_non_embedding(model) - stacked + stacked * k // n:,} active" in flops.formula


def test_a_dense_model_counts_every_parameter():
    model, inputs = zoo.build("gpt-tiny", "meta")
    flops = infer_model_flops(model, inputs, trace_model(model, inputs))
    assert f"N = {_non_embedding(model):,} parameters without embeddings" in flops.formula


# -- every row states its sync mode; rows at another mode are named -------------------------------------------

def _result(rows: list[Scored], **kw) -> SearchResult:
    return SearchResult(best=rows[0], baselines={s.plan.label: s for s in rows[1:]}, candidates=tuple(rows),
                        memory_budget=float("inf"), **kw)


def test_rows_state_their_sync_mode_and_the_table_names_those_that_differ():
    g = zoo_graph("gpt-tiny")
    base = baselines(g, MESH)
    rows = [Scored(replace(base["per-block"], label="wrapopt"), _est(1.0, GiB, "every"), True),
            Scored(base["per-block"], _est(1.0, GiB, "every"), True),
            Scored(base["per-block,ckpt"], _est(1.1, 2 * GiB, "last"), True)]
    text = format_report(_result(rows), analytical_fabric(world_size=2), analytical_compute(), MESH)
    table = {line[2:].split()[0]: line for line in text.splitlines() if line[2:].startswith("per-block")}
    assert table["per-block"].rstrip().endswith("every") and table["per-block,ckpt"].rstrip().endswith("last")
    differ = next(line for line in text.splitlines() if "not at the first row's sync" in line)
    assert "per-block,ckpt" in differ and "(every)" in differ and "per-block," not in differ.replace(
        "per-block,ckpt", "")
    # without accumulation no row has a mode, and no sync column is printed
    plain = [replace(s, estimate=_est(s.estimate.step_s, s.estimate.peak_bytes)) for s in rows]
    text = format_report(_result(plain), analytical_fabric(world_size=2), analytical_compute(), MESH)
    assert " sync" not in next(line for line in text.splitlines() if "pred step" in line)


# -- the why line names the plan it follows --------------------------------------------------------------------

def _ckpt(plan, k: int, label: str):
    """``plan`` with its first ``k`` block units checkpointed."""
    units, done = [], 0
    for u in plan.units:
        if not u.is_root and done < k:
            u, done = replace(u, checkpoint=True), done + 1
        units.append(u)
    return replace(plan, units=tuple(units), label=label)


def test_the_why_of_a_partly_checkpointed_per_block_names_it_and_the_memory_reason():
    g = zoo_graph("gpt-tiny")
    per_block = baselines(g, MESH)["per-block"]
    n = len(g.blocks)
    budget = 10 * GiB
    plain = Scored(per_block, _est(1.0, 11 * GiB), False)  # over the budget: not among the fitting
    two = Scored(_ckpt(per_block, 2, "per-block,dp"), _est(1.1, 9 * GiB), True)
    every = Scored(_ckpt(per_block, n, "per-block,ckpt"), _est(1.3, 5 * GiB), True)
    c = choose(g, [every, two], budget)
    assert c.best is two
    assert c.why.startswith(f"per-block with 2 of {n} blocks checkpointed: nothing beats it"), c.why
    assert not c.why.startswith("per-block:") and plain.plan.label == "per-block"
    assert f"no per-block cut checkpointing fewer fits the budget less the memory model's {MEMORY_ERROR:.1%}" in c.why


def test_the_why_of_a_tensor_parallel_choice_names_the_degree():
    from wrapopt.search.tp import lift_plan
    from wrapopt.tp import builtin_tp_plan

    g = zoo_graph("llama-tiny")
    per_block = baselines(g, MESH)["per-block"]
    c = choose(g, [Scored(per_block, _est(1.0, GiB), True)], float("inf"))
    assert c.why.startswith("per-block: nothing beats it")  # the conventional cut, as the benchmarks read it
    lifted = Scored(lift_plan(per_block, 2, builtin_tp_plan(g)), _est(1.0, GiB), True)
    why = choice_why(_result([lifted], why=c.why, tp_chosen=2))
    assert why.startswith("per-block + tp2: nothing beats it"), why
    beaten = choice_why(_result([lifted], why=f"beats per-block by 10.0% (> {STEP_ERROR:.1%})", tp_chosen=2))
    assert beaten.startswith("beats per-block by 10.0%") and beaten.endswith("(at tp2)")


def test_a_plan_beating_a_checkpointed_per_block_says_which_per_block_it_beat():
    g = zoo_graph("gpt-tiny")
    per_block = baselines(g, MESH)["per-block"]
    pairs = make_plan(g, MESH, [list(g.blocks[:2]), list(g.blocks[2:])], label="pairs")
    ref = Scored(_ckpt(per_block, 1, "per-block,dp"), _est(1.0, GiB), True)
    c = choose(g, [ref, Scored(pairs, _est(0.8, GiB), True)], float("inf"))
    assert c.why.startswith("beats per-block by 25.0%") and "per-block here: per-block with 1 of" in c.why


# -- the batch in sequences per data-parallel rank -------------------------------------------------------------

def _assumptions(**kw) -> Assumptions:
    base = dict(loss="l", loss_kind="cross_entropy", loss_saved_bytes=0, loss_peak_bytes=0, optimizer="adamw",
                optimizer_states=2, optimizer_state_bytes=8.0, param_dtype="float32", gather_bytes=2.0,
                reduce_bytes=4.0, batch=1.0, traced_batch=1, seq=8192, memory_budget_bytes=None,
                memory_budget_source="none", fabric="f", fabric_kind="analytical", compute="c",
                compute_kind="analytical")
    return Assumptions(**{**base, **kw})


@pytest.mark.parametrize("kw, want", [
    (dict(batch=0.25, tp_size=4, grad_accumulation=8),
     "1 sequence x 8192 tokens per data-parallel rank (TorchTitan's local_batch_size), 8 micro-batches per step; "
     "the 4 tensor-parallel GPUs"),
    (dict(batch=2.0, traced_batch=1), "2 sequences x 8192 tokens per data-parallel rank"),
    # a pipeline of 4 stages, 8 micro-batches of 1 sequence: each rank's share is 8 / 4 of the traced batch
    (dict(batch=2.0, pp_size=4, pipeline_microbatches=8),
     "8 sequences x 8192 tokens per pipeline (TorchTitan's local_batch_size), in micro-batches of 1 sequence, 8 per"),
], ids=["tp4", "scaled", "pipeline"])
def test_the_batch_line_speaks_in_sequences_per_data_parallel_rank(kw, want):
    line = _assumptions(**kw).batch_line()
    assert want in line, line
    assert "0.25" not in line and "scaled x" not in line


def test_a_tensor_parallel_search_states_its_recorded_micro_batch(capsys):
    out = _cli(["search", "zoo:llama-tiny", "--world-size", "4", "--gpu", "h100-sxm", "--tp", "2",
                "--global-batch", "4", "--trials", "0", "--json"], capsys)
    plan = json.loads(out)
    mb, acc = plan["train"]["micro_batch"], plan["train"]["grad_accumulation"]
    stated = Assumptions.from_json(plan["assumptions"])
    assert stated.tp_size == 2 and stated.micro_batch == pytest.approx(mb)
    assert f"{mb} sequence" in stated.batch_line() and (acc == 1 or f"{acc} micro-batches" in stated.batch_line())


def test_the_current_configuration_rows_state_their_sync_mode():
    from types import SimpleNamespace as NS

    from wrapopt.report.current import format_current

    g = zoo_graph("gpt-tiny")
    per_block = baselines(g, MESH)["per-block"]

    def config(step_s: float, sync: str) -> NS:
        return NS(plan=per_block, micro_batch=1, accumulation=4, estimate=_est(step_s, GiB, sync),
                  sequences_per_s_per_rank=4 / step_s)

    cur, best = config(2.0, "every"), config(1.0, "last")
    text = format_current(NS(current=cur, chosen=best, current_text="per-block", speedup=2.0, gains=()))
    rows = {line.split()[0]: line for line in text.splitlines()[2:4]}
    assert rows["current"].endswith("sync every") and rows["wrapopt"].endswith("sync last")
    assert "the rows differ in gradient sync" in text
