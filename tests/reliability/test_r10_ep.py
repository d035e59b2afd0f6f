"""Expert parallelism said wrongly or where it cannot run (issue 53): one line each, naming the degree,
the module and the degrees that would; and MFU's active parameters for experts held as modules."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from tests.reliability.common import ERROR, assert_api_refuses, assert_cli_refuses, case
from wrapopt import zoo
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import OptionError, PlanError
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.plan.ep import check_ep
from wrapopt.report.estimate import infer_model_flops
from wrapopt.search.baselines import baselines
from wrapopt.search.shapes import shape_space
from wrapopt.spec import MeshSpec, ParallelRequest, PlanSpec, UnitSpec
from wrapopt.trace import trace_model

MESH8 = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


@pytest.fixture(scope="module")
def moe():
    model, x = zoo.build("moe-tiny", "meta")
    return trace_model(model, x, fx=False)


@pytest.mark.parametrize("argv,code,fragments", [
    case(["search", "zoo:moe-tiny", "--world-size", "6", "--gpus-per-node", "6", "--ep", "3", "--trials", "0"], ERROR,
         "--ep 3 does not divide the 4 experts of blocks.0.ffn", "degrees that do: 2, 4", id="ep-3-of-4-experts"),
    case(["search", "zoo:gpt-tiny", "--world-size", "8", "--ep", "2", "--trials", "0"], ERROR,
         "--ep 2", "no stacked experts", "--ep 1", id="ep-on-a-dense-model"),
])
def test_cli_refuses_an_ep_degree_the_model_cannot_take(argv, code, fragments, capsys):
    assert_cli_refuses(argv, code, fragments, capsys)


def test_the_search_names_the_degrees_that_would(moe):
    req = ParallelRequest(mesh=MeshSpec(world_size=6, ranks_per_node=6, shard_size=6), ep=3)
    assert_api_refuses(lambda: shape_space(moe, req), PlanError, ("--ep 3", "blocks.0.ffn", "degrees that do: 2, 4"))
    assert shape_space(moe, ParallelRequest(mesh=MESH8, ep=2, global_batch=16)).ep == (2,)  # searched since
    assert_api_refuses(lambda: shape_space(moe, ParallelRequest(mesh=MESH8, ep=2, tp=2)), OptionError,
                       ("--ep 2 with --tp 2", "no cost model of experts under tensor parallelism", "--tp 1"))
    piped = shape_space(moe, ParallelRequest(mesh=MESH8, ep=4, pp="auto")).piped  # searched since: ep in a stage
    assert [(s.pp, s.ep) for s in piped] == [(2, 4)]  # pp 4 leaves a stage 2 ranks, fewer than ep 4
    assert ParallelRequest(mesh=MESH8, ep="auto", cp="auto").ep == "auto"  # searched since: [Note: cp with ep]
    assert_api_refuses(lambda: ParallelRequest(mesh=MESH8, ep="auto", cp="auto", global_batch=16), OptionError,
                       ("--cp auto with --ep auto and --global-batch", "pass one of them as 1"))
    auto = shape_space(moe, ParallelRequest(mesh=MeshSpec(world_size=2, ranks_per_node=2, shard_size=2), ep="auto"))
    assert auto.ep == (2,) and any("ep 4 not tried" in n and "2 ranks" in n for n in auto.notes)


def test_a_plan_whose_ep_does_not_divide_the_experts_is_refused_when_scored(moe):
    sim = Simulator(moe, analytical_fabric(world_size=8), analytical_compute())
    plan = baselines(moe, MESH8)["per-block"]
    bad = replace(plan, mesh=replace(MESH8, ep_size=8))
    assert_api_refuses(lambda: sim.simulate(bad), PlanError, ("--ep 8", "4 experts", "degrees that do: 2, 4"))


def test_apply_refuses_what_it_does_not_apply():
    model = zoo.build("moe-tiny", "meta")[0]
    units = (UnitSpec(("",), False),)
    hsdp = PlanSpec(units, MeshSpec(world_size=8, ranks_per_node=8, shard_size=4, ep_size=2))
    assert check_ep(model, hsdp)  # applied since: ep inside each shard group (tests/plan/test_ep_apply.py)
    with_cp = PlanSpec(units, MeshSpec(world_size=8, ranks_per_node=8, shard_size=8, cp_size=2, ep_size=2))
    assert_api_refuses(lambda: check_ep(model, with_cp), PlanError, ("mesh.cp_size 2", "--ep 1 or --cp 1",
                                                                     "--to torchtitan"))
    odd = PlanSpec(units, replace(MESH8, ep_size=8))
    assert_api_refuses(lambda: check_ep(model, odd), PlanError, ("mesh.ep_size 8", "4 experts of blocks.0.ffn",
                                                                 "degrees that do: 2, 4"))
    dense = zoo.build("gpt-tiny", "meta")[0]
    assert_api_refuses(lambda: check_ep(dense, PlanSpec(units, replace(MESH8, ep_size=2))), PlanError,
                       ("no experts module", "--ep 1"))


class _Expert(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _ListMoE(nn.Module):
    """Experts as an ``nn.ModuleList`` of modules (each runs on its routed tokens only), top-2 of 8."""

    def __init__(self, vocab: int = 64, d: int = 32, h: int = 64, n: int = 8, k: int = 2):
        super().__init__()
        self.top_k = k
        self.emb, self.router = nn.Embedding(vocab, d), nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(_Expert(d, h) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids).reshape(-1, self.emb.embedding_dim)
        w, idx = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, choice = torch.where(idx == e)
            out = out.index_add(0, rows, expert(x[rows]) * w[rows, choice, None])
        return self.head(out).reshape(*ids.shape, -1)


def test_mfu_counts_the_active_experts_of_a_module_list():
    model, ids = _ListMoE(), torch.randint(0, 64, (2, 16))
    flops = infer_model_flops(model, (ids,), trace_model(model, (ids,), fx=False))
    experts = sum(p.numel() for p in model.experts.parameters())
    dense = model.router.weight.numel() + model.head.weight.numel()
    active = dense + experts * 2 // 8  # top-2 of 8: a quarter of the experts' weights
    assert f"N = {active:,} active parameters without embeddings (experts: top-2 of 8)" in flops.formula
