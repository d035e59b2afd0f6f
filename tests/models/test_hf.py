"""``hf:config.json`` on tiny configs of the architectures users train: each builds the
class its config names (or its task's), traces on meta with the model's own loss and
is searched without error; MoE experts are charged their routed share of FLOPs; bad
configs are refused in one line naming the field.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from tests.models.hf_configs import MOE, archs, num_experts, write_config  # noqa: E402
from wrapopt.cost.simulate import Simulator  # noqa: E402
from wrapopt.errors import ModelError  # noqa: E402
from wrapopt.hardware import analytical_compute, analytical_fabric  # noqa: E402
from wrapopt.models.sources import resolve_model  # noqa: E402
from wrapopt.search.driver import SearchOptions, search_plan  # noqa: E402
from wrapopt.spec import MeshSpec  # noqa: E402
from wrapopt.trace.meta import trace_model  # noqa: E402
from wrapopt.units import validate_plan  # noqa: E402

BATCH, SEQ = 2, 8
ARCHS = sorted(archs())
ENC_DEC = ("t5", "bart", "whisper")


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf"))


def test_the_list_has_at_least_twenty_architectures_with_every_one_the_issue_names():
    named = {"mixtral", "qwen2_moe", "deepseek_v3", "bert", "bart", "whisper", "llama", "qwen2", "mistral", "gemma2",
             "phi3", "gpt2", "gpt_neox", "opt", "t5", "vit"}
    assert len(ARCHS) >= 20 and named <= set(ARCHS)


@pytest.mark.parametrize("name", ARCHS)
def test_architecture_builds_traces_on_meta_and_searches(name, config_dir):
    src = resolve_model(f"hf:{write_config(name, config_dir)}", batch=BATCH, seq=SEQ)
    model = src.build("meta")
    assert type(model).__name__ == archs()[name][1]
    assert all(p.is_meta for p in model.parameters())
    graph = trace_model(model, src.inputs)
    assert graph.loss_kind == "model"  # labels among the inputs: the model's own loss
    assert graph.batch_size == BATCH and sum(m.fwd_flops for m in graph.modules) > 0
    kept_real = [e for e in graph.estimates if "integer inputs kept real" in e]
    assert bool(kept_real) == (name in ("bart", "t5", "whisper")), graph.estimates  # decoders read their mask
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    sim = Simulator(graph, analytical_fabric(world_size=8), analytical_compute())
    result = search_plan(graph, sim, mesh, options=SearchOptions(trials=10, seed=0))
    validate_plan(graph, result.best.plan)
    assert result.best.fits


@pytest.mark.parametrize("name", MOE)
def test_moe_experts_cost_the_routed_share_and_hold_every_expert(name, config_dir):
    src = resolve_model(f"hf:{write_config(name, config_dir)}", batch=BATCH, seq=SEQ)
    model = src.build("meta")
    graph = trace_model(model, src.inputs)
    config = model.config
    n, k = num_experts(config), config.num_experts_per_tok
    experts = [m for m in graph.modules if m.cls.endswith("Experts")]
    assert experts
    for m in experts:
        per_expert = m.own_numel / n
        assert m.own_numel == sum(p.numel() for p in model.get_submodule(m.fqn).parameters())  # all experts
        # each routed (token, expert) pair multiplies by one expert's matrices: 2 FLOPs per weight
        assert m.fwd_flops == pytest.approx(2 * BATCH * SEQ * k * per_expert), m.fqn
        assert m.fwd_flops < 2 * BATCH * SEQ * m.own_numel  # not every expert on every token
        assert m.experts == n, m.fqn  # the per-expert count, read off the stacked weights in the trace
    assert {m.fqn for m in graph.modules if m.experts} == {m.fqn for m in experts}


def test_without_architectures_the_task_follows_the_config(config_dir):
    for name, want in (("whisper", "WhisperForConditionalGeneration"), ("distilbert", "DistilBertForMaskedLM"),
                       ("roberta", "RobertaForMaskedLM"), ("vit", "ViTForImageClassification")):
        src = resolve_model(f"hf:{write_config(name, config_dir)}", batch=BATCH, seq=SEQ)
        assert type(src.build("meta")).__name__ == want
    whisper = resolve_model(f"hf:{write_config('whisper', config_dir)}", batch=BATCH, seq=SEQ).inputs
    assert whisper[0].shape == (BATCH, 8, 32) and whisper[0].is_floating_point()  # log-mel features, 2 x 16 frames
    vit = resolve_model(f"hf:{write_config('vit', config_dir)}", batch=BATCH).inputs
    assert vit[0].shape == (BATCH, 3, 16, 16) and vit[1].shape == (BATCH,) and int(vit[1].max()) < 3  # labels


@pytest.mark.parametrize("name", ENC_DEC)
def test_encoder_decoders_get_decoder_inputs_and_labels(name, config_dir):
    src = resolve_model(f"hf:{write_config(name, config_dir)}", batch=BATCH, seq=SEQ)
    out = src.build("cpu")(*src.inputs)
    assert out.loss.requires_grad and out.logits.shape[:2] == (BATCH, SEQ)


@pytest.mark.parametrize("fields, words", [
    ({"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "x.Y"}}, "field `auto_map`"),
    ({"model_type": "llama", "architectures": ["LlamaForTimeTravel"]},
     "field `architectures` names 'LlamaForTimeTravel'"),
    ({"model_type": "no-such-model"}, "field `model_type` = 'no-such-model'"),
    ({"hidden_size": 8}, "no `model_type` field"),
    ({"model_type": "patchtst"}, "PatchTSTModel.forward needs `past_values`"),
])
def test_a_config_transformers_cannot_build_is_one_line_naming_the_field(fields, words, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ModelError) as err:
        resolve_model(f"hf:{path}")
    assert words in str(err.value) and "\n" not in str(err.value)
    assert any(w in str(err.value) for w in ("package.module:callable", "remove `architectures`", "add the one"))


@pytest.mark.parametrize("arch, change, words", [
    ("llama", {"pad_token_id": 500}, "field `pad_token_id` = 500 is outside the vocabulary (`vocab_size` = 128); "
                                     "give a token id from 0 to 127"),
    ("bart", {"decoder_start_token_id": -1}, "field `decoder_start_token_id` = -1 is outside the vocabulary"),
    ("llama", {"vocab_size": 0}, "field `vocab_size` must be a positive integer, got 0"),
    ("llama", {"hidden_size": "big"}, "field `hidden_size` must be a positive integer, got 'big'"),
    ("gpt2", {"n_head": 3}, "field `n_head` = 3 does not divide `n_embd` = 32"),
    ("bart", {"encoder_attention_heads": 5}, "field `encoder_attention_heads` = 5 does not divide `d_model` = 32"),
    ("llama", {"num_key_value_heads": 3}, "field `num_key_value_heads` = 3 does not divide `num_attention_heads` = 2"),
    # head_dim set: transformers' own check, translated
    ("llama", {"num_attention_heads": 3}, "refuses this llama config: ValueError: The hidden size (32) is not a "
                                          "multiple of the number of attention heads (3); fix the field"),
])
def test_bad_config_fields_are_one_line_naming_the_file_and_the_field(arch, change, words, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**archs()[arch][0]().to_dict(), **change}))
    with pytest.raises(ModelError) as err:
        resolve_model(f"hf:{path}")
    msg = str(err.value)
    assert msg.startswith(f"hf:{path}: ") and words in msg and "\n" not in msg, msg


def test_a_build_error_names_the_class_and_the_config(tmp_path, monkeypatch):
    from wrapopt.models import hf

    monkeypatch.setattr(hf, "check_config_fields", lambda cfg, where: ())  # what the fields check would stop
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**archs()["llama"][0]().to_dict(), "pad_token_id": 500}))
    with pytest.raises(ModelError) as err:
        resolve_model(f"hf:{path}")
    assert "building LlamaForCausalLM from this config failed (AssertionError: Padding_idx must be within" \
        in str(err.value) and "\n" not in str(err.value)


def test_a_folder_holding_config_json_is_a_model_as_transformers_takes_it(config_dir, tmp_path):
    import shutil

    folder = tmp_path / "llama"
    folder.mkdir()
    shutil.copy(write_config("llama", config_dir), folder / "config.json")
    assert type(resolve_model(f"hf:{folder}", batch=BATCH, seq=SEQ).build("meta")).__name__ == "LlamaForCausalLM"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match=r"the folder holds no config.json"):
        resolve_model(f"hf:{empty}", batch=BATCH, seq=SEQ)


def test_special_token_ids_outside_the_vocabulary_are_a_warning(tmp_path):
    """transformers builds and trains such configs (it only warns): bos and eos are never indexes."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**archs()["llama"][0]().to_dict(), "eos_token_id": [2, 128], "bos_token_id": 500}))
    src = resolve_model(f"hf:{path}")
    assert type(src.build("meta")).__name__ == "LlamaForCausalLM"
    assert any("field `eos_token_id` = 128 is outside the vocabulary" in n and "planned as given" in n
               for n in src.notes)
    assert any("field `bos_token_id` = 500" in n for n in src.notes)
