"""2-D plans (FSDP x tensor parallel) without ranks: the plan file's tp fields, the
checks apply runs before any collective, the exports that refuse, the data helper.
The multi-process side (parity, collective counts, meta init, bench) is test_tp_ranks.py."""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from tests.plan.common import load_data
from tests.ranks import HF_LLAMA_TP, MESH_2X2, tp_plan_specs, zoo_graph
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop.export import export_plan
from wrapopt.launch import dp_rank_size
from wrapopt.models import zoo
from wrapopt.plan.apply import apply_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.plan.tp import tp_layout
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


def _apply(name: str, mesh: MeshSpec, tp: TPSpec, model=None) -> str:
    model = zoo.get_entry(name).build("meta") if model is None else model
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


def _switched(plan: WrapPlan, **flags) -> TPSpec:
    return replace(plan.spec.tp, **{"sequence_parallel": True, "loss_parallel": True, **flags})


def test_a_degree_not_dividing_the_vocabulary_is_refused_with_the_degrees_that_work(llama_plan):
    with torch.device("meta"):
        odd = zoo.Llama(vocab=2047, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn=176)  # 2047 = 23 x 89
    msg = _apply("llama-tiny", MESH_2X2, _switched(llama_plan, sequence_parallel=False), odd)
    assert msg.startswith("tensor-parallel degree 2 does not divide the vocabulary (2047 output features of "
                          "lm_head), which loss parallel split"), msg
    assert "dividing it (1, 23)" in msg and msg.endswith("loss_parallel=False (--no-loss-parallel)")
    msg = _apply("llama-tiny", MESH_2X2, _switched(llama_plan), odd)
    assert "which loss parallel and sequence parallel split" in msg and "--no-sequence-parallel" in msg


def test_a_norm_sequence_parallel_cannot_place_is_named_with_the_option_to_turn_it_off(llama_plan):
    model = zoo.get_entry("llama-tiny").build("meta")
    model.layers[3].post_attention_layernorm = nn.Sequential(zoo.RMSNorm(64))  # one level down
    msg = _apply("llama-tiny", MESH_2X2, _switched(llama_plan), model)
    assert msg.startswith("block layers.3: norm post_attention_layernorm.0 (RMSNorm) is not a direct child"), msg
    assert "sequence_parallel=False (--no-sequence-parallel)" in msg
    # the same model without sequence parallel: only the vocabulary's split is asked for, and allowed
    blocks = tuple(f"layers.{i}" for i in range(6))
    spec = PlanSpec((UnitSpec(blocks), UnitSpec((ROOT,), False)), MESH_2X2,
                    tp=_switched(llama_plan, sequence_parallel=False))
    assert tp_layout(model, spec.tp, 2, "cpu").head == "lm_head"


def test_parameters_outside_the_blocks_are_refused_for_sequence_parallel(llama_plan):
    model = zoo.get_entry("llama-tiny").build("meta")
    model.scale = nn.Parameter(torch.ones(64, device="meta"))
    msg = _apply("llama-tiny", MESH_2X2, _switched(llama_plan), model)
    assert "Llama holds parameters of its own (scale)" in msg and "--no-sequence-parallel" in msg


def test_a_hugging_face_llama_keeps_its_embedding_whole_and_cuts_the_first_blocks_input():
    transformers = pytest.importorskip("transformers", reason="the Hugging Face Llama needs transformers")
    from wrapopt.tp import builtin_tp_plan
    from wrapopt.trace.meta import trace_model

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    graph = trace_model(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    tp = replace(builtin_tp_plan(graph), sequence_parallel=True, loss_parallel=True)
    got = tp_layout(model, tp, 2, "cpu")
    # See [Note: applying sequence parallel] in plan/tp.py: LlamaModel reads the embedding's output whole.
    assert (got.head, got.embed, got.positions, got.final_norm, got.entry) == (
        "lm_head", "model.embed_tokens", (), "model.norm", "model.layers.0")
    assert got.block_norms == tuple(f"model.layers.{i}.{n}" for i in range(2)
                                    for n in ("input_layernorm", "post_attention_layernorm"))
    assert sorted(got.gathers) == [f"model.layers.{i}.{n}" for i in range(2) for n in ("mlp", "self_attn")]
    assert tp.styles("LlamaDecoderLayer") == dict(HF_LLAMA_TP), "the parity case in test_tp_ranks.py uses it"


def test_hugging_face_models_sequence_parallel_does_not_cover_are_refused(llama_plan):
    # a Hugging Face decoder with a positional embedding (here the zoo GPT in transformers' clothes)
    hf_class = type("GPT2LMHeadModel", (zoo.GPT,), {"__module__": "transformers.models.gpt2.modeling_gpt2"})
    hf = zoo.get_entry("gpt-tiny").build("meta")
    hf.__class__ = hf_class
    gpt = replace(tp_plan_specs(zoo_graph("gpt-tiny"))["groups-of-2"].tp, sequence_parallel=True, loss_parallel=True)
    msg = _apply("gpt-tiny", MESH_2X2, gpt, hf)
    assert msg.startswith("wpe: sequence parallel on Hugging Face's GPT2LMHeadModel keeps the embeddings' outputs "
                          "whole"), msg
    assert msg.endswith("sequence_parallel=False (--no-sequence-parallel)")


def test_async_tp_is_refused_on_cpu(llama_plan):
    msg = _apply("llama-tiny", MESH_2X2, _switched(llama_plan, async_tp=True))
    assert "async tensor parallelism (tp.async_tp), which is GPU-only" in msg and "these ranks run on cpu" in msg


def test_the_layout_places_gpt_tinys_tied_embedding_positions_norms_and_head(gpt_tiny):
    model, _inputs, graph = gpt_tiny
    tp = replace(tp_plan_specs(graph)["groups-of-2"].tp, sequence_parallel=True, loss_parallel=True)
    got = tp_layout(model, tp, 2, "cpu")
    assert (got.head, got.embed, got.positions, got.final_norm) == ("lm_head", "wte", ("wpe",), "ln_f")
    assert got.block_norms == tuple(f"layers.{i}.{n}" for i in range(4) for n in ("ln_1", "ln_2"))
    assert got.gathers == tuple(f"layers.{i}.{n}" for i in range(4) for n in ("attn", "mlp"))
    assert tp_layout(model, replace(tp, sequence_parallel=False, loss_parallel=False), 2, "cpu") is None


def test_loss_context_is_loss_parallel_only_where_the_plan_says(llama_plan):
    from torch.distributed.tensor.parallel import loss_parallel

    assert isinstance(llama_plan.loss_context(), contextlib.nullcontext)
    lp = WrapPlan(spec=replace(llama_plan.spec, tp=_switched(llama_plan, sequence_parallel=False)),
                  model=llama_plan.model)
    assert type(lp.loss_context()) is type(loss_parallel())


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


def test_a_norm_inside_a_split_attention_is_refused_on_the_live_model():
    """Qwen3's per-head q_norm: its gradient would stay a per-rank partial sum."""
    import torch.nn as nn

    from wrapopt.errors import PlanError
    from wrapopt.plan.tp import check_tp_model
    from wrapopt.spec import TPSpec

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
            self.q_norm = nn.LayerNorm(2)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

    model = nn.Sequential(Block())
    spec = TPSpec(layers=(("Block", (("attn.q", "colwise"), ("attn.k", "colwise"), ("attn.v", "colwise"),
                                     ("attn.o", "rowwise"))),))
    with pytest.raises(PlanError, match=r"0.attn.q_norm \(LayerNorm\) holds parameters inside 0.attn, which "
                                        r"tensor parallelism splits"):
        check_tp_model(model, spec, 2)
