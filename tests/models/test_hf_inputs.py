"""``hf:`` example inputs sized from the config: images of its ``image_size`` and
``num_channels`` (nested in CLIP's ``vision_config``), raw audio for Wav2Vec2-like
encoders with a CTC transcript, text within the model's positions; a ``forward``
needing an input wrapopt cannot make is refused naming it. See [Note: Hugging Face
example inputs] in wrapopt/models/hf.py.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from tests.models.hf_configs import write_config  # noqa: E402
from wrapopt.cli.main import main  # noqa: E402
from wrapopt.errors import ModelError  # noqa: E402
from wrapopt.models.sources import resolve_model  # noqa: E402
from wrapopt.trace.meta import trace_model  # noqa: E402

_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
_CONV = dict(conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
             num_conv_pos_embedding_groups=2, **_VIT, vocab_size=32, pad_token_id=0)


def _write(tmp_path, name: str, cfg) -> str:
    path = str(tmp_path / f"{name}.json")
    cfg.to_json_file(path)
    return path


def _clip(image_size: int):
    text = dict(**_VIT, vocab_size=128, max_position_embeddings=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.CLIPConfig(text_config=text, vision_config=dict(**_VIT, image_size=image_size, patch_size=8,
                                                                        num_channels=1),
                                   projection_dim=16, architectures=["CLIPModel"])


CONFIGS = {
    "clip": lambda: _clip(32),
    "swin": lambda: transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                            window_size=4, num_labels=3, num_channels=4,
                                            architectures=["SwinForImageClassification"]),
    "wav2vec2-ctc": lambda: transformers.Wav2Vec2Config(**_CONV, architectures=["Wav2Vec2ForCTC"]),
    "wav2vec2": lambda: transformers.Wav2Vec2Config(**_CONV, architectures=["Wav2Vec2Model"]),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inputs_follow_the_config_and_the_model_traces(name, tmp_path):
    cfg = CONFIGS[name]()
    src = resolve_model(f"hf:{_write(tmp_path, name, cfg)}", batch=2, seq=12)
    graph = trace_model(src.build("meta"), src.inputs, loss_fn=src.loss)
    assert graph.num_params > 0
    images = [x for x in src.inputs if hasattr(x, "dim") and x.dim() == 4]
    if name in ("clip", "swin"):
        vision = getattr(cfg, "vision_config", cfg)
        assert tuple(images[0].shape) == (2, vision.num_channels, vision.image_size, vision.image_size)
    if name.startswith("wav2vec2"):
        audio = src.inputs[0]
        assert audio.dim() == 2 and audio.shape[1] >= 12 * 10  # 12 frames of 5 x 2 samples each
    if name == "wav2vec2-ctc":
        labels = src.inputs[2]
        assert labels.shape == (2, 3) and int(labels.min()) > 0  # no blank (pad) token in a transcript


def test_a_real_ctc_step_computes_its_loss(tmp_path):
    src = resolve_model(f"hf:{_write(tmp_path, 'ctc', CONFIGS['wav2vec2-ctc']())}", batch=2, seq=12)
    out = src.build("cpu")(*src.inputs)
    assert out.loss is not None and bool(out.loss.isfinite())


def test_seq_beyond_the_positions_is_an_error_naming_the_limit(tmp_path):
    path = write_config("llama", str(tmp_path))  # max_position_embeddings = 64
    with pytest.raises(ModelError,
                       match=r"--seq 65 is beyond the model's positions \(`max_position_embeddings` = 64\)"):
        resolve_model(f"hf:{path}", batch=1, seq=65)
    assert resolve_model(f"hf:{path}", batch=1, seq="context").inputs[0].shape == (1, 64)
    assert resolve_model(f"hf:{path}", batch=1).inputs[0].shape == (1, 64)  # no --seq: 128 or fewer
    assert main(["estimate", f"hf:{path}", "--world-size", "2", "--seq", "context", "--json"]) == 0
    assert main(["estimate", f"hf:{path}", "--world-size", "2", "--seq", "65"]) == 1


def test_an_input_wrapopt_cannot_make_is_named_with_the_way_to_supply_it(tmp_path):
    cfg = transformers.TimeSeriesTransformerConfig(prediction_length=4, context_length=8, d_model=16, encoder_layers=1,
                                                   decoder_layers=1, lags_sequence=[1, 2],
                                                   architectures=["TimeSeriesTransformerForPrediction"])
    with pytest.raises(ModelError, match=r"forward needs `past_values`.*package\.module:callable returning \(model, "
                                         r"example_inputs\)"):
        resolve_model(f"hf:{_write(tmp_path, 'ts', cfg)}", batch=1, seq=8)


def test_estimate_counts_tokens_of_an_hf_language_model_beside_its_labels(tmp_path, capsys):
    """An hf: causal LM's inputs are input_ids and labels (both integer): it is a token model,
    so tokens/s/GPU and MFU are printed (they were null: "exactly one integer input")."""
    import json

    path = write_config("llama", str(tmp_path))
    assert main(["estimate", f"hf:{path}", "--world-size", "2", "--seq", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_per_s_per_gpu"] is not None and out["tokens_per_s_per_gpu"] > 0
    assert out["mfu"] is not None and "T = 16" in out["flops_formula"]
