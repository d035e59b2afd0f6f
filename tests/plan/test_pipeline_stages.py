"""A pipeline plan's stages checked against the live model, in one process (no ranks):
what ``apply_pipeline`` refuses before any collective, each with the module, the stage and
what to do. The applied plan's training is in test_pipeline_ranks.py."""

from __future__ import annotations

import pytest

from wrapopt.errors import PlanError
from wrapopt.models import zoo
from wrapopt.plan.apply import apply_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.plan.pipeline import apply_pipeline
from wrapopt.plan.stages import block_chains, stage_layout
from wrapopt.spec import ROOT, MeshSpec, PipelineSpec, PlanSpec, TPSpec, UnitSpec

MESH = MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, pp_size=2)
LLAMA = (("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.3", "layers.4", "layers.5", "norm", "lm_head"))


def spec(stages, *, units=None, schedule="1F1B", microbatches=2, mesh=MESH, tp=None) -> PlanSpec:
    blocks = [m for s in stages for m in s if m.startswith("layers.") and m.count(".") == 1]
    units = units if units is not None else tuple(UnitSpec((b,)) for b in blocks) + (UnitSpec((ROOT,), False),)
    return PlanSpec(units, mesh, tp=tp, pipeline=PipelineSpec(stages=stages, schedule=schedule,
                                                              microbatches=microbatches))


def refusal(name: str, plan: PlanSpec) -> str:
    with pytest.raises(PlanError) as e:
        stage_layout(zoo.get_entry(name).build("meta"), plan)
    return str(e.value)


@pytest.fixture(scope="module")
def llama():
    return zoo.get_entry("llama-tiny").build("meta")


def test_the_stages_of_a_chain_model_give_the_split_points(llama):
    layout = stage_layout(llama, spec(LLAMA))
    assert layout.chain == "layers" and layout.split_points == ("layers.3",)
    assert layout.stage_of("layers.4.mlp.up_proj") == 1 and layout.stage_of("embed_tokens") == 0
    four = (("embed_tokens", "layers.0", "layers.1"), ("layers.2",), ("layers.3", "layers.4"),
            ("layers.5", "norm", "lm_head"))
    assert stage_layout(llama, spec(four, schedule="Interleaved1F1B", microbatches=4)).split_points == (
        "layers.2", "layers.3", "layers.5")
    gpt = (("wte", "wpe", "layers.0", "layers.1"), ("layers.2", "layers.3", "ln_f", "lm_head"))
    assert stage_layout(zoo.get_entry("gpt-tiny").build("meta"), spec(gpt)).split_points == ("layers.2",)


@pytest.mark.parametrize("stages, words", [
    ((("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.3", "layers.4", "layers.5", "norm", "lm_hed")),
     ["stage 1 lists 'lm_hed'", "does not have", "layers.0 .. layers.5"]),
    ((("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.2", "layers.3", "layers.4", "layers.5", "norm",
                                                              "lm_head")),
     ["'layers.2' is in pipeline stages 0 and 1", "drop it from one"]),
    ((("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.3.mlp", "layers.4", "layers.5", "norm",
                                                              "lm_head")),
     ["stage 1 lists 'layers.3.mlp', a part of 'layers.3'", "list 'layers.3'"]),
    ((("embed_tokens", "layers"), ("norm", "lm_head")), ["holds the block chain layers", "list the blocks"]),
    ((("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.4", "layers.5", "norm", "lm_head")),
     ["block 'layers.3' is in no pipeline stage", "add it to stage 0"]),
    ((("embed_tokens", "layers.0", "layers.1", "layers.3"), ("layers.2", "layers.4", "layers.5", "norm", "lm_head")),
     ["'layers.3' is on pipeline stage 0 but 'layers.2'", "consecutive blocks in execution order"]),
    ((("layers.0", "layers.1", "layers.2"), ("embed_tokens", "layers.3", "layers.4", "layers.5", "norm", "lm_head")),
     ["'embed_tokens' runs before the first block (embeddings)", "move it to stage 0"]),
    ((("embed_tokens", "layers.0", "layers.1", "layers.2", "lm_head"), ("layers.3", "layers.4", "layers.5", "norm")),
     ["'lm_head' runs after the last block", "pipeline stage 1, not stage 0", "move it to stage 1"]),
    ((("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.3", "layers.4", "layers.5", "lm_head")),
     ["'norm' is in no pipeline stage", "add it to stage 1"]),
], ids=["unknown", "two-stages", "part-of-block", "chain", "missing-block", "order", "embeddings", "head",
        "missing-norm"])
def test_a_stage_list_that_does_not_match_the_model_is_refused_naming_module_and_stage(stages, words):
    msg = refusal("llama-tiny", spec(stages))
    assert all(w in msg for w in words), msg


def test_an_encoder_decoder_is_refused_for_pipelining_with_the_reason():
    t5 = zoo.get_entry("t5-tiny").build("meta")
    assert block_chains(t5) == ["encoder.blocks", "decoder.blocks"]
    stages = (("shared", "encoder"), ("decoder", "lm_head"))
    msg = refusal("t5-tiny", spec(stages, units=(UnitSpec((ROOT,), False),)))
    assert "one sequential chain" in msg and "encoder.blocks, decoder.blocks" in msg and "pp_size 1" in msg, msg


def test_parameters_on_the_root_are_refused():
    msg = refusal("vit-tiny", spec((("patch_embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "norm",
                                                                             "head"))))
    assert "cls_token" in msg and "move them into a submodule" in msg, msg


def test_units_across_stages_and_schedules_against_stages_are_refused():
    across = tuple(UnitSpec((f"layers.{i}", f"layers.{i + 1}")) for i in (0, 2, 4)) + (UnitSpec((ROOT,), False),)
    msg = refusal("llama-tiny", spec(LLAMA, units=across))
    assert "unit 'layers.2..3' spans pipeline stages 0 and 1" in msg and "split it at the stage boundary" in msg, msg
    four = (("embed_tokens", "layers.0", "layers.1"), ("layers.2",), ("layers.3", "layers.4"),
            ("layers.5", "norm", "lm_head"))
    msg = refusal("llama-tiny", spec(four, schedule="GPipe"))
    assert "GPipe runs one stage per pipeline rank" in msg and "use Interleaved1F1B" in msg, msg
    msg = refusal("llama-tiny", spec(four, schedule="Interleaved1F1B", microbatches=5))
    assert "multiple of 2" in msg, msg
    tp = TPSpec(layers=(("LlamaBlock", (("self_attn.q_proj", "colwise"),)),))
    msg = refusal("llama-tiny", spec(LLAMA, mesh=MeshSpec(world_size=8, ranks_per_node=8, shard_size=2, tp_size=2,
                                                          pp_size=2), tp=tp))
    assert "tensor parallelism is not applied yet" in msg, msg


def test_apply_plan_points_a_pipeline_plan_to_the_pipeline_path_and_its_arguments(llama):
    with pytest.raises(PlanError, match="example_inputs=.*loss_fn="):
        apply_plan(llama, spec(LLAMA))
    with pytest.raises(PlanError, match="needs example_inputs and loss_fn"):
        apply_pipeline(llama, spec(LLAMA), example_inputs=None, loss_fn=None)
    with pytest.raises(PlanError, match="needs loss_fn"):
        WrapPlan(spec=spec(LLAMA), model={}).apply(llama, strict=False, example_inputs=(None,))
