"""A tensor-parallel degree that does not divide a Hugging Face attention's heads is refused
when the plan is searched and when it is applied, before any collective (issue 33): Llama-
family attentions keep their head counts in their config, not in an attribute of their own."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from tests.models.hf_configs import write_config  # noqa: E402
from wrapopt.errors import PlanError  # noqa: E402
from wrapopt.models.sources import resolve_model  # noqa: E402
from wrapopt.plan.apply import apply_plan  # noqa: E402
from wrapopt.search.tp import resolve_tp  # noqa: E402
from wrapopt.spec import ROOT, MeshSpec, ParallelRequest, PlanSpec, UnitSpec  # noqa: E402
from wrapopt.tp import TPSpec  # noqa: E402
from wrapopt.trace.meta import trace_model  # noqa: E402

# The user's plan: every projection's features divide by 2, but the model has 1 key-value head.
USER_TP = TPSpec(layers=(("LlamaDecoderLayer", (
    ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
    ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
    ("mlp.down_proj", "rowwise"))),), source="user")
WORDS = "tensor-parallel degree 2 does not divide the heads of model.layers.0.self_attn (2 heads, 1 key-value heads)"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    src = resolve_model(f"hf:{write_config('llama', str(tmp_path_factory.mktemp('hf')))}", batch=2, seq=8)
    return src.build("meta"), trace_model(src.build("meta"), src.inputs)


def test_the_search_refuses_a_degree_not_dividing_the_heads(llama):
    _model, graph = llama
    assert ("model.layers.0.self_attn", 2, 1) in graph.attention_heads
    with pytest.raises(PlanError) as err:
        resolve_tp(graph, ParallelRequest(mesh=MeshSpec(world_size=2, ranks_per_node=2, shard_size=2), tp=2,
                                          tp_plan=USER_TP))
    assert WORDS in str(err.value)
    auto = ParallelRequest(mesh=MeshSpec(world_size=4, ranks_per_node=4, shard_size=4), tp="auto", tp_plan=USER_TP)
    degrees, _spec, _notes = resolve_tp(graph, auto)
    assert degrees == (1,)  # auto drops the degree instead


def test_apply_refuses_it_before_any_collective(llama):
    model, _graph = llama
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=1, tp_size=2)
    spec = PlanSpec((UnitSpec((ROOT,), False),), mesh, tp=USER_TP)
    with pytest.raises(PlanError) as err:  # no process group: it fails in the local checks
        apply_plan(model, spec)
    assert WORDS in str(err.value) and "\n" not in str(err.value)
