"""Context (and expert) parallelism's bad input: degrees the mesh, the request, the plan file or
``--current`` rule out are named, with the degrees that would do (issue 53)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.plan.common import load_data
from wrapopt.errors import OptionError, PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop.export import export_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import ROOT, MeshSpec, ParallelRequest, PlanSpec, UnitSpec


def test_the_mesh_names_a_cp_degree_outside_the_shard_group():
    with pytest.raises(OptionError) as e:
        MeshSpec(world_size=8, ranks_per_node=8, shard_size=4, cp_size=8)
    assert "context-parallel degree 8 does not divide the shard group of 4" in str(e.value)
    assert "use cp 2, 4" in str(e.value)
    with pytest.raises(OptionError, match=r"expert-parallel degree 3 does not divide dp_shard x cp x tp = 8 ranks"):
        MeshSpec(world_size=8, ranks_per_node=8, shard_size=4, tp_size=2, ep_size=3)


def test_the_mesh_axes_under_cp():
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=8, cp_size=4)
    assert mesh.shape == (2, 2, 4) and mesh.axis_names == ("replicate", "shard", "cp")
    assert (mesh.dp_shard, mesh.batch_size, mesh.dp_size, mesh.replicate_size) == (2, 4, 16, 2)
    flat = mesh.data_parallel()  # FSDP's collectives over dp_shard x cp, flattened
    assert flat == MeshSpec(world_size=16, ranks_per_node=8, shard_size=8)
    tp = MeshSpec(world_size=16, ranks_per_node=8, shard_size=4, tp_size=2, cp_size=2, ep_size=4)
    assert tp.axis_names == ("replicate", "shard", "cp", "tp") and tp.efsdp_size == 2
    assert tp.data_parallel() == MeshSpec(world_size=8, ranks_per_node=4, shard_size=4)
    assert MeshSpec(world_size=8, ranks_per_node=8, shard_size=8).with_cp(2).cp_size == 2


def test_the_request_names_cp_and_ep_degrees_the_world_rules_out():
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    with pytest.raises(OptionError) as e:
        ParallelRequest(mesh=mesh, tp=2, cp=3)
    assert str(e.value).startswith("--cp 3: the context-parallel degree does not divide the 4 ranks left by tp")
    assert "degrees that do: 2, 4" in str(e.value)
    with pytest.raises(OptionError, match="--cp must be auto or a positive integer, got 'two'"):
        ParallelRequest(mesh=mesh, cp="two")
    ok = ParallelRequest(mesh=mesh, cp="auto", ep=1)
    assert ok.searches_cp and ok.asks_cp and not ok.asks_ep
    assert ParallelRequest(mesh=mesh, ep="4").ep == 4


@pytest.fixture(scope="module")
def cp_plan(llama_tiny) -> WrapPlan:
    model, _inputs, graph = llama_tiny
    spec = PlanSpec(tuple(UnitSpec((b,)) for b in graph.blocks) + (UnitSpec((ROOT,), False),),
                    MeshSpec(world_size=8, ranks_per_node=8, shard_size=8, cp_size=2))
    return WrapPlan(spec=spec, model=model_fingerprint(model))


def test_a_cp_plan_round_trips_and_an_old_file_reads_as_cp_1(cp_plan, tmp_path):
    path = tmp_path / "cp.json"
    cp_plan.save(path)
    raw = json.loads(path.read_text())
    assert raw["mesh"]["cp_size"] == 2 and raw["mesh"]["axis_names"] == ["shard", "cp"]
    assert WrapPlan.load(path).spec == cp_plan.spec
    old = copy.deepcopy(raw)
    for key in ("cp_size", "shape", "axis_names"):
        old["mesh"].pop(key)
    assert load_data(tmp_path, old).spec.mesh.cp_size == 1


def test_a_plan_file_with_a_bad_cp_size_is_named(cp_plan, tmp_path):
    raw = cp_plan.to_json()
    raw["mesh"]["cp_size"] = 3
    raw["mesh"].pop("shape"), raw["mesh"].pop("axis_names")
    with pytest.raises(PlanError, match=r"field 'mesh' context-parallel degree 3 does not divide the shard group"):
        load_data(tmp_path, raw)
    raw["mesh"]["cp_size"] = 0
    with pytest.raises(PlanError, match=r"field 'mesh.cp_size' must be a positive int, got 0"):
        load_data(tmp_path, raw)


def test_exports_carry_or_refuse_cp(cp_plan):
    titan = export_plan(cp_plan, to="torchtitan")
    par = titan.settings["parallelism"]
    assert (par["context_parallel_degree"], par["data_parallel_shard_degree"]) == (2, 4)
    assert titan.fields["cp"] == "written"
    with pytest.raises(PlanError, match=r"runs context parallelism \(degree 2\).*--to torchtitan"):
        export_plan(cp_plan, to="accelerate")


def test_current_reads_cp_and_ep_words_and_names_bad_ones(llama_tiny):
    from wrapopt.search.current import parse_current

    graph = llama_tiny[2]
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    cur = parse_current("per-block, full AC, cp 2", graph, mesh)
    assert cur.plan.mesh.cp_size == 2 and cur.plan.mesh.shard_size == 8
    assert parse_current("per-block, ep 4", graph, mesh).plan.mesh.ep_size == 4
    with pytest.raises(OptionError, match=r"context-parallel degree 8 does not divide the shard group of 4"):
        parse_current("per-block, shard 4, cp 8", graph, mesh)
    with pytest.raises(OptionError, match=r"'cp 2' and 'cp 4' contradict each other"):
        parse_current("per-block, cp 2, cp 4", graph, mesh)
    with pytest.raises(OptionError, match=r"cp needs FSDP's shard group"):
        parse_current("no-shard, cp 2", graph, mesh)


class _MatmulAttention(torch.nn.Module):
    """Attention written as matmuls and a softmax: nothing for context_parallel to replace."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(1, 2) / 4.0, dim=-1) @ v)


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn, self.mlp = _MatmulAttention(d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class _NoSdpaLM(torch.nn.Module):
    def __init__(self, d: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embed, self.blocks = torch.nn.Embedding(vocab, d), torch.nn.ModuleList(_Block(d) for _ in range(2))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_cp_on_attention_without_sdpa_is_refused_naming_the_module():
    from wrapopt.search.cp import resolve_cp
    from wrapopt.trace.meta import trace_model

    graph = trace_model(_NoSdpaLM(), (torch.zeros(2, 16, dtype=torch.long),))
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=4)
    with pytest.raises(PlanError) as e:
        resolve_cp(graph, ParallelRequest(mesh=mesh, cp=2))
    assert str(e.value).startswith("--cp 2: blocks.0.attn (_MatmulAttention) computes attention without "
                                   "scaled_dot_product_attention")
    assert resolve_cp(graph, ParallelRequest(mesh=mesh, cp="auto"))[1][0].startswith(
        "--cp auto: context parallelism not tried: blocks.0.attn")


def test_a_cp_degree_that_does_not_split_the_sequence_names_those_that_do(llama_tiny, capsys):
    from wrapopt.cli.main import main as cli
    from wrapopt.search.cp import resolve_cp

    graph = llama_tiny[2]  # 64 tokens
    mesh = MeshSpec(world_size=48, ranks_per_node=8, shard_size=48)
    with pytest.raises(OptionError) as e:
        resolve_cp(graph, ParallelRequest(mesh=mesh, cp=3))
    assert str(e.value) == ("--cp 3 does not split the sequence of 64 tokens into 2 x 3 chunks (the causal load "
                            "balancer's); degrees that do: 2, 4, 8, 16")
    assert cli(["search", "zoo:llama-tiny", "--world-size", "48", "--cp", "3", "--trials", "0"]) != 0
    assert "degrees that do: 2, 4, 8, 16" in capsys.readouterr().err
    with pytest.raises(OptionError, match=r"cp 3 does not split the sequence of 64 tokens into 2 x 3 chunks"):
        from wrapopt.search.current import parse_current
        parse_current("per-block, cp 3", graph, MeshSpec(world_size=6, ranks_per_node=6, shard_size=6))


def test_estimate_takes_a_cp_degree_not_auto(llama_tiny):
    from wrapopt.api import estimate

    model, x, _graph = llama_tiny
    two = estimate(model, x, world_size=8, cp=2)
    assert two.mesh.cp_size == 2 and two.mesh.batch_size == 4
    with pytest.raises(OptionError, match=r"--cp auto chooses a degree in `wrapopt search`"):
        estimate(model, x, world_size=8, cp="auto")
    with pytest.raises(OptionError, match=r"--cp 2: the plan's shard group of 1 ranks cannot hold cp groups of 2"):
        estimate(model, x, world_size=8, cp=2, plan="no-shard")


def test_estimate_takes_an_ep_degree_where_the_model_has_experts(llama_tiny):
    from wrapopt import zoo
    from wrapopt.api import estimate

    model, x = zoo.build("moe-tiny", "meta")
    two = estimate(model, x, world_size=8, ep=2)
    assert two.mesh.ep_size == 2 and two.plan_label.endswith(" + ep2")
    with pytest.raises(OptionError, match=r"--ep auto chooses a degree in `wrapopt search`"):
        estimate(model, x, world_size=8, ep="auto")
    from dataclasses import replace

    from wrapopt.search.axes import given_axes
    from wrapopt.search.baselines import baselines
    from wrapopt.trace import trace_model

    graph = trace_model(model, x, fx=False)
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    hsdp = replace(baselines(graph, mesh)["per-block"], mesh=replace(mesh, shard_size=4))
    assert given_axes(graph, hsdp, ParallelRequest(mesh=mesh, ep=2)).mesh.ep_size == 2  # ep inside shard groups
    unsharded = replace(hsdp, mesh=replace(mesh, shard_size=1))
    with pytest.raises(OptionError, match=r"--ep 2: the plan's shard group of 1 ranks cannot hold ep groups of 2 "
                                          r"\(it must be a multiple of 2\)"):
        given_axes(graph, unsharded, ParallelRequest(mesh=mesh, ep=2))
    with pytest.raises(PlanError, match=r"--ep 2.*no stacked experts"):
        estimate(llama_tiny[0], llama_tiny[1], world_size=8, ep=2)
