"""interop/export.py: a plan as an Accelerate config or Lightning strategy, exact
where the framework can express it, with a list of what it loses where not."""

from __future__ import annotations

import pytest

from tests.ranks import MESH2
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint, module_classes
from wrapopt.interop.export import class_policy, export_plan
from wrapopt.interop.policy import block_chains
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import baselines, make_plan
from wrapopt.spec import ROOT, PlanSpec, UnitSpec


def _plan(graph, model, modules, **kw) -> WrapPlan:
    mp = kw.pop("mixed_precision", None)
    spec = make_plan(graph, kw.pop("mesh", MESH2), modules, **kw)
    return WrapPlan(spec=spec, model=model_fingerprint(model), **({"mixed_precision": mp} if mp else {}))


def test_export_per_block_to_accelerate_is_exact(gpt_tiny):
    model, _, graph = gpt_tiny
    out = export_plan(_plan(graph, model, list(graph.blocks)), to="accelerate")
    assert out.exact and "LOSSES" not in out.text
    fsdp = out.settings["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "GPTBlock"
    assert fsdp["fsdp_reshard_after_forward"] is True and fsdp["fsdp_activation_checkpointing"] is False
    assert out.settings["num_processes"] == 2 and out.settings["distributed_type"] == "FSDP"
    assert "  fsdp_transformer_layer_cls_to_wrap: GPTBlock\n" in out.text
    assert "mixed_precision: 'no'\n" in out.text  # quoted: a bare no is a YAML boolean


def test_export_checkpointed_keep_units_is_exact(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = _plan(graph, model, list(graph.blocks), reshard_after_forward=False, checkpoint=True)
    acc = export_plan(plan, to="accelerate")
    assert acc.exact
    assert acc.settings["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert acc.settings["fsdp_config"]["fsdp_activation_checkpointing"] is True
    lit = export_plan(plan, to="lightning-fsdp1")
    assert lit.exact
    assert lit.settings["sharding_strategy"] == "SHARD_GRAD_OP"
    assert (lit.settings["auto_wrap_policy"] == lit.settings["activation_checkpointing_policy"]
            == ["wrapopt.models.zoo.GPTBlock"])
    assert "from wrapopt.models.zoo import GPTBlock" in lit.text and "auto_wrap_policy={GPTBlock}" in lit.text
    compile(lit.text, "lightning_export.py", "exec")  # valid Python


def test_export_lists_what_it_loses(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = _plan(graph, model, [("layers.0", "layers.1"), ("layers.2", "layers.3"), ("wte", "lm_head")],
                 forward_prefetch=2, mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    acc = export_plan(plan, to="accelerate")
    assert not acc.exact
    text = "\n".join(acc.losses)
    assert "2 grouped unit(s) of 2 blocks (layers.0 + layers.1, layers.2 + layers.3) become one unit per block" in text
    assert "fewer, larger all-gathers" in text  # what grouping bought, said
    assert "units that are not blocks are not wrapped (wte + lm_head)" in text
    assert "reduce_dtype float32" in text and "prefetch" in text
    assert acc.settings["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "GPTBlock"
    assert acc.settings["mixed_precision"] == "bf16"
    assert "# LOSSES" in acc.text and all(f"#   - {x}" in acc.text for x in acc.losses)
    lit = export_plan(plan, to="lightning-fsdp1")
    assert any("layers.0 + layers.1 becomes 2 units of one GPTBlock each" in x for x in lit.losses)
    assert any("wte + lm_head (Embedding, Linear) is not wrapped" in x for x in lit.losses)
    assert "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in lit.text
    assert "to_fsdp1_policy()" in lit.text  # the exact alternatives are named
    compile(lit.text, "lightning_export.py", "exec")


def test_export_drops_classes_with_instances_outside_the_plan(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = _plan(graph, model, [*graph.blocks, "wpe", "layers.0.attn.q_proj"])
    pol = class_policy(plan, module_classes(model), match_by_name=True)
    assert [c.rsplit(".", 1)[-1] for c in pol.classes] == ["GPTBlock"]
    assert any("Embedding units not wrapped (wpe)" in x and "wte" in x for x in pol.losses)
    assert any("Linear units not wrapped" in x for x in pol.losses)


def test_export_mixed_settings_take_the_majority_and_say_so(gpt_tiny):
    model, _, graph = gpt_tiny
    units = tuple(UnitSpec((b,), i != 0, i == 3) for i, b in enumerate(graph.blocks)) + (UnitSpec((ROOT,), False),)
    plan = WrapPlan(spec=PlanSpec(units, MESH2), model=model_fingerprint(model))
    pol = class_policy(plan, module_classes(model), match_by_name=False)
    assert pol.reshard_after_forward is True and pol.checkpoint is False
    assert any("layers.0" in x and "reshard_after_forward=False" in x for x in pol.losses)
    assert any("checkpointing is off" in x and "layers.3" in x for x in pol.losses)


def test_export_root_only_and_no_shard(gpt_tiny):
    model, _, graph = gpt_tiny
    b = baselines(graph, MESH2)
    root = export_plan(WrapPlan(spec=b["root-only"], model=model_fingerprint(model)), to="accelerate")
    assert root.exact and root.settings["fsdp_config"]["fsdp_auto_wrap_policy"] == "NO_WRAP"
    ddp = export_plan(WrapPlan(spec=b["no-shard"], model=model_fingerprint(model)), to="accelerate")
    assert ddp.settings["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in ddp.settings
    assert export_plan(WrapPlan(spec=b["no-shard"], model=model_fingerprint(model)), to="lightning-fsdp1").settings[
        "sharding_strategy"] == "NO_SHARD"


def test_export_of_an_old_plan_needs_the_model(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = _plan(graph, model, list(graph.blocks))
    plan.model.pop("module_classes")
    with pytest.raises(PlanError, match="--model"):
        export_plan(plan, to="accelerate")
    assert export_plan(plan, to="accelerate", model=model).exact
    with pytest.raises(ValueError, match="accelerate, lightning, lightning-fsdp2, lightning-fsdp1"):
        export_plan(plan, to="deepspeed", model=model)


def test_block_chains_read_from_the_plan_file_are_the_tracers(gpt_tiny, llama_tiny):
    for model, _, graph in (gpt_tiny, llama_tiny):
        fp = model_fingerprint(model)
        assert block_chains(fp["module_classes"], list(fp["params"])) == graph.block_chains


def _user_plan(graph, model) -> WrapPlan:
    """The plan a user exported (issue 34): the embedding, each MLP (checkpointed) and each o_proj
    as units, no block a unit. The closest class policy wrapped Embedding and the MLP class."""
    units = [UnitSpec(("embed_tokens",), True)]
    units += [UnitSpec((f"{b}.mlp",), True, True) for b in graph.blocks]
    units += [UnitSpec((f"{b}.self_attn.o_proj",), True) for b in graph.blocks]
    return WrapPlan(spec=PlanSpec((*units, UnitSpec((ROOT,), True)), MESH2), model=model_fingerprint(model))


def test_accelerate_wraps_the_block_class_when_the_plan_cuts_inside_blocks(llama_tiny):
    model, _, graph = llama_tiny
    plan = _user_plan(graph, model)
    old = class_policy(plan, module_classes(model), match_by_name=True)
    assert {c.rsplit(".", 1)[-1] for c in old.classes} == {"Embedding", "SwiGLU"}  # what the user got
    acc = export_plan(plan, to="accelerate")
    fsdp = acc.settings["fsdp_config"]
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "LlamaBlock"
    assert fsdp["fsdp_activation_checkpointing"] is False  # no block is checkpointed in the plan
    text = "\n".join(acc.losses)
    assert "12 sub-block unit(s) (layers.0.mlp, layers.1.mlp" in text and "become part of their block" in text
    assert "units that are not blocks are not wrapped (embed_tokens)" in text
    assert "checkpointing of units that are not blocks is lost (layers.0.mlp" in text


def test_accelerate_checkpoints_the_blocks_only(llama_tiny):
    model, _, graph = llama_tiny
    units = [UnitSpec((b,), True, True) for b in graph.blocks] + [UnitSpec(("embed_tokens",), True, True)]
    plan = WrapPlan(spec=PlanSpec((*units, UnitSpec((ROOT,), True)), MESH2), model=model_fingerprint(model))
    acc = export_plan(plan, to="accelerate")
    fsdp = acc.settings["fsdp_config"]
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "LlamaBlock"  # not Embedding: it would be checkpointed
    assert fsdp["fsdp_activation_checkpointing"] is True
    assert any("(embed_tokens)" in x and "not blocks" in x for x in acc.losses)


def test_accelerate_names_the_blocks_the_plan_leaves_to_the_root(llama_tiny):
    model, _, graph = llama_tiny
    acc = export_plan(_plan(graph, model, list(graph.blocks[:4])), to="accelerate")
    assert acc.settings["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaBlock"
    assert any("also wraps 2 module(s) the plan leaves to a parent unit (layers.4, layers.5)" in x for x in acc.losses)
