"""2-D plans (FSDP x tensor parallel) without ranks: the plan file's tp fields, the
checks apply runs before any collective, the exports that refuse, the data helper.
The multi-process side (parity, collective counts, meta init, bench) is test_tp_ranks.py."""

from __future__ import annotations

import copy
import json

import pytest

from tests.plan.common import load_data
from tests.ranks import MESH_2X2, tp_plan_specs
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop.export import export_plan
from wrapopt.launch import dp_rank_size
from wrapopt.models import zoo
from wrapopt.plan.apply import apply_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec
from wrapopt.tp import TPSpec


@pytest.fixture(scope="module")
def llama_plan(llama_tiny) -> WrapPlan:
    model, _inputs, graph = llama_tiny
    return WrapPlan(spec=tp_plan_specs(graph)["groups-of-2"], model=model_fingerprint(model))



# --- the plan file --------------------------------------------------------------------------------


def test_a_tp_plan_round_trips_through_the_file(llama_plan, tmp_path):
    path = tmp_path / "tp.json"
    llama_plan.save(path)
    raw = json.loads(path.read_text())
    assert (raw["mesh"]["tp_size"] == 2 and raw["mesh"]["axis_names"] == ["shard", "tp"]
            and raw["mesh"]["shape"] == [2, 2])
    assert raw["tp"]["source"] == "builtin" and raw["tp"]["layers"]["LlamaBlock"]["self_attn.o_proj"] == "rowwise"
    back = WrapPlan.load(path)
    assert back.spec == llama_plan.spec  # units, mesh (tp_size included) and the TPSpec, in order
    assert back.spec.tp.styles("LlamaBlock") == llama_plan.spec.tp.styles("LlamaBlock")
    assert back.to_json() == llama_plan.to_json()


def test_a_plan_without_tp_loads_as_before(gpt_tiny, tmp_path):
    model, _inputs, graph = gpt_tiny
    spec = PlanSpec((UnitSpec(graph.blocks), UnitSpec((ROOT,), False)),
                    MeshSpec(world_size=2, ranks_per_node=2, shard_size=2))
    data = WrapPlan(spec=spec, model=model_fingerprint(model)).to_json()
    assert "tp" not in data and "tp_size" not in data["mesh"]
    back = load_data(tmp_path, data)
    assert back.spec.tp is None and back.mesh.tp_size == 1 and back.spec == spec


@pytest.mark.parametrize("change, field, words", [
    (lambda d: d["tp"]["layers"]["LlamaBlock"].update({"self_attn.q_proj": "col"}),
     "tp.layers.LlamaBlock.self_attn.q_proj", "style must be colwise or rowwise, got 'col'"),
    (lambda d: d.pop("tp"), "tp", "mesh.tp_size 2 needs its tensor-parallel plan"),
    (lambda d: d["tp"].update(layers={}), "tp.layers", "non-empty object"),
    (lambda d: d["tp"]["layers"].update(LlamaBlock=["self_attn.q_proj"]), "tp.layers.LlamaBlock", "non-empty object"),
    (lambda d: d["tp"].update(source="guess"), "tp.source", "builtin, user"),
    (lambda d: d["tp"].update(layer={}), "tp.layer", "not a field of tp"),
    (lambda d: d["mesh"].update(tp_size=0), "mesh.tp_size", "positive int"),
    (lambda d: d["mesh"].update(tp_size=3), "mesh", "tensor-parallel degree 3"),
    (lambda d: d["mesh"].update(tp_size=1, shape=[2], axis_names=["shard"]), "tp", "mesh.tp_size is 1"),
    (lambda d: d["mesh"].update(axis_names=["shard", "shard"]), "mesh.axis_names", "give [\"shard\", \"tp\"]"),
])
def test_tp_field_errors_name_the_file_and_the_field(llama_plan, tmp_path, change, field, words):
    data = copy.deepcopy(llama_plan.to_json())
    change(data)
    with pytest.raises(PlanError) as exc:
        load_data(tmp_path, data)
    msg = str(exc.value)
    assert "plan.json: field " + repr(field) in msg and words in msg, msg
    assert "\n" not in msg


# --- checks before any collective (no process group is needed to reach them) ------------------------


def _tp(cls: str, *pairs: tuple[str, str]) -> TPSpec:
    return TPSpec(layers=((cls, pairs),), source="user")


def _apply(name: str, mesh: MeshSpec, tp: TPSpec) -> str:
    model = zoo.get_entry(name).build("meta")
    blocks = tuple(n for n, m in model.named_modules() if n.count(".") == 1 and n.startswith("layers."))
    spec = PlanSpec((UnitSpec(blocks), UnitSpec((ROOT,), False)), mesh, tp=tp)
    with pytest.raises(PlanError) as exc:
        apply_plan(model, spec)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_a_degree_not_dividing_the_heads_is_refused(llama_plan):
    # llama-tiny: 4 heads, 2 key-value heads; every projection's features divide by 4.
    msg = _apply("llama-tiny", MeshSpec(world_size=4, ranks_per_node=4, shard_size=1, tp_size=4), llama_plan.spec.tp)
    assert "degree 4 does not divide the heads of layers.0.self_attn (4 heads, 2 key-value heads)" in msg


def test_a_degree_not_dividing_the_features_is_refused(llama_plan):
    msg = _apply("llama-tiny", MeshSpec(world_size=3, ranks_per_node=3, shard_size=1, tp_size=3), llama_plan.spec.tp)
    assert "degree 3 does not divide the 176 input features of layers.0.mlp.down_proj" in msg


def test_a_missing_path_and_a_non_linear_path_are_refused():
    msg = _apply("llama-tiny", MESH_2X2, _tp("LlamaBlock", ("self_attn.qq_proj", "colwise")))
    assert ("LlamaBlock names self_attn.qq_proj" in msg and "layers.0 has no submodule" in msg
            and "self_attn.q_proj" in msg)
    msg = _apply("llama-tiny", MESH_2X2, _tp("LlamaBlock", ("input_layernorm", "colwise")))
    assert "layers.0.input_layernorm is a RMSNorm, not an nn.Linear" in msg


def test_a_tp_plan_for_a_class_the_model_lacks_is_refused():
    msg = _apply("gpt-tiny", MESH_2X2, _tp("LlamaBlock", ("self_attn.q_proj", "colwise")))
    assert "block class LlamaBlock, which this GPT does not have" in msg and "GPTBlock" in msg


# --- exports that cannot express tensor parallelism --------------------------------------------------


def test_fsdp1_and_the_interop_exports_refuse_a_tp_plan(llama_plan, llama_tiny):
    with pytest.raises(PlanError, match="does not support FSDP1 \\+ tensor parallelism"):
        llama_plan.to_fsdp1_policy()
    for target in ("accelerate", "lightning", "lightning-fsdp1"):
        with pytest.raises(PlanError, match=f"cannot export to {target}"):
            export_plan(llama_plan, to=target)


# --- the data helper ---------------------------------------------------------------------------------


def test_dp_rank_size_puts_tensor_parallel_peers_on_one_batch():
    assert [dp_rank_size(MESH_2X2, r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    hsdp = MeshSpec(world_size=16, ranks_per_node=8, shard_size=2, tp_size=2)  # replicate 4 x shard 2 x tp 2
    assert hsdp.axis_names == ("replicate", "shard", "tp")
    assert [dp_rank_size(hsdp, r)[0] for r in range(16)] == [r // 2 for r in range(16)]
    assert dp_rank_size(MeshSpec(world_size=4, ranks_per_node=4, shard_size=4), 3) == (3, 4)
    with pytest.raises(ValueError, match="rank 4 is outside the mesh of 4 ranks"):
        dp_rank_size(MESH_2X2, 4)
