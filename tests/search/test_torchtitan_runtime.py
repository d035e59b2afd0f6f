"""``--runtime torchtitan``: the search scores only the plans TorchTitan's job config can say
(See [Note: TorchTitan's plans] in search/torchtitan.py), so the export carries its answer whole.
The strategy passes the conformance suite like every registered one."""

from __future__ import annotations

import json

import pytest

from wrapopt.cli.main import main
from wrapopt.job import prepare
from wrapopt.models import zoo
from wrapopt.search.driver import search_plan
from wrapopt.search.strategy import SearchOptions, Strategy
from wrapopt.search.torchtitan import TorchTitanLayouts
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.testing.pytest_strategies import *  # noqa: F401,F403


@pytest.fixture
def strategy() -> Strategy:
    return TorchTitanLayouts()


def _search(name: str):
    model, x = zoo.build(name, "meta")
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    job = prepare(ParallelRequest(mesh=mesh, memory_budget="none"), model, x, loss_fn=zoo.get_entry(name).loss)
    return job.graph, search_plan(job.graph, job.sim, mesh, options=SearchOptions(runtime="torchtitan"))


def test_only_torchtitans_units_are_scored():
    graph, res = _search("llama-tiny")
    assert {s.strategy for s in res.candidates} == {"torchtitan"}
    units = [u.modules for u in res.best.plan.units]
    assert units == [("embed_tokens",), *((b,) for b in graph.blocks), ("norm", "lm_head"), ("",)]
    for s in res.candidates:  # one reshard choice for the embedding and the blocks; [norm, output] kept
        *front, tail, _root = s.plan.units
        assert len({u.reshard_after_forward for u in front}) == 1 and tail.reshard_after_forward is False


def test_a_tied_embedding_and_head_stay_in_the_root():
    graph, res = _search("gpt-tiny")
    assert [u.modules for u in res.best.plan.units] == [*((b,) for b in graph.blocks), ("",)]


def test_the_export_of_its_answer_loses_nothing(tmp_path):
    out, toml = tmp_path / "plan.json", tmp_path / "job.toml"
    assert main(["search", "zoo:llama-tiny", "--world-size", "8", "--gpus-per-node", "4", "--tp", "2", "--runtime",
                 "torchtitan", "--trials", "0", "--no-compile", "--out", str(out)]) == 0
    notes = json.loads(out.read_text())["fabric"]["notes"]
    assert any(n.startswith("--async-tp auto: off under --runtime torchtitan without compile") for n in notes)
    assert main(["export", str(out), "--to", "torchtitan", "--out", str(toml), "--strict"]) == 0
    assert "tensor_parallel_degree = 2" in toml.read_text()


def test_a_plan_file_tells_the_ends_apart_by_class(tmp_path):
    """A plan file's parameters are sorted by name (Hugging Face's ``lm_head`` before ``model.*``):
    the export tells the embedding's end from the head's by class, not by that order."""
    from wrapopt.interop.torchtitan import _BlockLayout

    classes = {"torch.nn.modules.sparse.Embedding": ["model.embed_tokens"], "torch.nn.modules.linear.Linear":
               ["lm_head"], "Block": ["model.layers.0", "model.layers.1"], "RMSNorm": ["model.norm"]}
    params = sorted(["model.embed_tokens.weight", "model.layers.0.w", "model.layers.1.w", "model.norm.weight",
                     "lm_head.weight"])
    layout = _BlockLayout(classes, params, ordered=False)
    assert layout.before("model.embed_tokens") and not layout.after("model.embed_tokens")
    assert layout.after("lm_head") and layout.after("model.norm") and not layout.before("lm_head")
