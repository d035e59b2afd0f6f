"""``hf:config.json``: Hugging Face models built from their config, on any device (meta included).

[Note: which Hugging Face class] A config from the hub names the class it was
saved from in ``architectures``; that class is built. Without it, the first
task whose Auto class accepts the config's ``model_type`` is taken, in
``_TASKS`` order: sequence-to-sequence LM and speech-to-text for
encoder-decoders, masked LM for encoders (BERT-like configs are also accepted
by the causal-LM Auto class, but only as decoders), causal LM, image
classification; the bare model (no head, no loss of its own) is the last
resort. A config that needs remote code (``auto_map``) or names a class this
transformers lacks is refused in one line naming the field.

[Note: Hugging Face example inputs] The example inputs are one per-rank batch
of the modality the class's ``forward`` takes: token ids (``input_ids``),
images (``pixel_values``) or log-mel features (``input_features``, Whisper's
fixed 30 s window), plus decoder token ids for encoder-decoders and
``labels`` wherever ``forward`` takes them, so the model computes the loss it
trains with. ``use_cache`` keeps the config's value, as in a training loop
that does not set it. They are passed by position in ``forward``'s order (its defaults in between), so a
plain ``model(*inputs)`` runs them. Encoder-decoders also get a
``decoder_attention_mask`` of ones: BART's decoder would otherwise build one
on the model's (meta) device and read it with ``.item()``; given as an
integer input, the tracer keeps it real (See [Note: integer inputs stay
real] in trace/meta.py).
"""

from __future__ import annotations

import copy
import inspect
import os
from typing import Any

import torch
import torch.nn as nn

from wrapopt.checks import check_count
from wrapopt.errors import ModelError, OptionError
from wrapopt.fileio import read_json
from wrapopt.models.base import ModelSource

__all__ = ["hf_source", "check_config_fields", "TASKS"]

# (task, name of the model_type -> class name mapping in transformers.models.auto.modeling_auto)
TASKS = (
    ("sequence-to-sequence LM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("speech-to-text", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    ("masked LM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("causal LM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("image classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("bare model", "MODEL_MAPPING_NAMES"),
)
# Models at most this large train real steps on a CPU (``ModelSource.trainable_here``).
_TRAINABLE_MAX_PARAMS = 50_000_000


def hf_source(path: str, batch: int | None, seq: int | None) -> ModelSource:
    """``hf:path/to/config.json``: a Hugging Face model built from its config (no weights)."""
    # absent: the defaults; given: checked, never replaced (See [Note: numbers where they enter] in checks.py)
    batch = 1 if batch is None else check_count(batch, f"the batch of hf:{path} (--batch)")
    seq_given, seq = seq is not None, 128 if seq is None else check_count(seq, "--seq")
    if not os.path.isfile(path):
        raise ModelError(f"hf:{path}: no such config file (give the path to a config.json)")
    try:
        import transformers  # lazy: transformers is an optional extra (wrapopt[hf]) and slow to import
    except ImportError:
        raise ModelError("hf: models need transformers: pip install 'wrapopt[hf]'") from None
    cfg_dict = read_json(path, error=ModelError)
    if not isinstance(cfg_dict, dict):
        raise ModelError(f"hf:{path}: a config file is a JSON object, got {type(cfg_dict).__name__}")
    if cfg_dict.get("auto_map"):
        raise ModelError(
            f"hf:{path}: field `auto_map` asks for the model's own code (trust_remote_code), which wrapopt never "
            "runs from a config; pass MODEL as package.module:callable returning (model, example_inputs)")
    if "model_type" not in cfg_dict:
        raise ModelError(f"hf:{path}: no `model_type` field; add the one the model's Hugging Face config.json "
                         "names (e.g. \"model_type\": \"llama\")")
    check_config_fields(cfg_dict, f"hf:{path}")
    if seq_given:
        _check_seq(cfg_dict, seq, f"hf:{path}")
    try:
        config = transformers.AutoConfig.for_model(**cfg_dict)
    except Exception as e:  # noqa: BLE001 (ValueError, KeyError, huggingface_hub's strict-dataclass errors)
        if cfg_dict["model_type"] in transformers.CONFIG_MAPPING:  # known: a field does not fit the others
            raise ModelError(f"hf:{path}: transformers {transformers.__version__} refuses this "
                             f"{cfg_dict['model_type']} config: {_last_line(e)}; fix the field it names, or pass "
                             "MODEL as package.module:callable") from None
        raise ModelError(f"hf:{path}: field `model_type` = {cfg_dict['model_type']!r}: transformers "
                         f"{transformers.__version__} cannot build this config, it is unknown to it; upgrade "
                         "transformers or pass MODEL as package.module:callable") from None
    cls, task = _model_class(transformers, config, cfg_dict, path)

    def build(device: str) -> nn.Module:
        torch.manual_seed(0)
        kwargs = {}
        if torch.device(device).type == "cpu" and _has_grouped_experts(cls):
            # The CPU grouped-matmul kernel has no float32 backward; on meta the tracer runs it
            # (See [Note: experts on meta] in trace/ops.py), as GPUs do.
            kwargs["experts_implementation"] = "eager"
        with torch.device(device):  # a copy: transformers writes the experts implementation into the config
            return cls._from_config(copy.deepcopy(config), **kwargs)

    try:
        model = build("meta")
    except Exception as e:  # noqa: BLE001 (transformers' own error, translated: See check_config_fields)
        raise ModelError(f"hf:{path}: building {cls.__name__} from this config failed ({type(e).__name__}: "
                         f"{_last_line(e)}); fix the config's fields, or pass MODEL as package.module:callable") from e
    inputs = _example_inputs(cls, config, batch, seq, path)
    small = sum(p.numel() for p in model.parameters()) <= _TRAINABLE_MAX_PARAMS
    return ModelSource(f"hf:{path}", build, inputs, None, small)


# Fields that, when a config has them, count something: positive integers.
_SIZES = ("vocab_size", "hidden_size", "n_embd", "d_model", "dim", "intermediate_size", "ffn_dim", "d_ff", "n_inner",
          "encoder_ffn_dim", "decoder_ffn_dim", "num_hidden_layers", "n_layer", "num_layers", "n_layers",
          "encoder_layers", "decoder_layers", "num_attention_heads", "n_head", "n_heads", "num_heads",
          "encoder_attention_heads", "decoder_attention_heads", "num_key_value_heads", "head_dim", "d_kv",
          "max_position_embeddings", "n_positions")
# (width field, heads field): the heads split the width, unless the config sets ``head_dim`` itself.
_WIDTH_HEADS = (("hidden_size", "num_attention_heads"), ("n_embd", "n_head"), ("d_model", "encoder_attention_heads"),
                ("d_model", "decoder_attention_heads"), ("dim", "n_heads"))
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def check_config_fields(cfg: dict[str, Any], where: str) -> None:
    """``ModelError`` naming ``where`` (the config file), the field and the fix when a size is not a
    positive integer, the attention heads do not split the width (or the key-value heads the
    heads), or a token id lies outside the vocabulary: checked before transformers builds anything."""
    for name in _SIZES:
        v = cfg.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ModelError(f"{where}: field `{name}` must be a positive integer, got {v!r}; "
                             f"write a number without quotes, e.g. \"{name}\": 64")
    for width, heads in _WIDTH_HEADS:
        w, h = cfg.get(width), cfg.get(heads)
        if w and h and cfg.get("head_dim") is None and w % h:
            raise ModelError(f"{where}: field `{heads}` = {h} does not divide `{width}` = {w} (each head gets "
                             f"{width} / {heads} features); give a number of heads that divides {w}")
    h, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if h and kv and h % kv:
        raise ModelError(f"{where}: field `num_key_value_heads` = {kv} does not divide `num_attention_heads` = {h}; "
                         f"give a divisor of {h} (each key-value head serves a group of query heads)")
    vocab = cfg.get("vocab_size")
    for name in _TOKEN_IDS:
        ids = cfg.get(name)
        for i in ids if isinstance(ids, list) else [ids]:
            if i is None or (isinstance(i, int) and not isinstance(i, bool) and (vocab is None or 0 <= i < vocab)):
                continue
            within = f"0 to {vocab - 1}" if vocab else "0 or more"
            raise ModelError(f"{where}: field `{name}` = {i!r} is outside the vocabulary (`vocab_size` = {vocab}); "
                             f"give a token id from {within}, or null")


# Fields that bound a token sequence: learned positions, or the decoder's length.
_POSITIONS = ("max_position_embeddings", "n_positions", "max_target_positions")


def _check_seq(cfg: dict[str, Any], seq: int, where: str) -> None:
    """``--seq`` past the config's positions is an error naming the field, not a sequence cut short."""
    for name in _POSITIONS:
        limit = cfg.get(name)
        if isinstance(limit, int) and seq > limit:
            raise OptionError(f"--seq {seq} is past the limit of {where}: field `{name}` = {limit}; "
                              f"give --seq {limit} or less")


def _last_line(e: BaseException) -> str:
    """The last line of an error's message: huggingface_hub's validation errors put the cause there."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1][:300].rstrip(".") if lines else type(e).__name__


def _model_class(transformers: Any, config: Any, cfg_dict: dict, path: str) -> tuple[type, str]:
    """The class to build and its task. See [Note: which Hugging Face class]."""
    archs = cfg_dict.get("architectures") or []
    if archs:
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ModelError(f"hf:{path}: field `architectures` is a list of class names, got {archs!r}")
        cls = getattr(transformers, archs[0], None)
        if not isinstance(cls, type) or not issubclass(cls, nn.Module):
            raise ModelError(
                f"hf:{path}: field `architectures` names {archs[0]!r}, which transformers {transformers.__version__} "
                "does not have; upgrade transformers, or remove `architectures` to build the task's Auto class")
        return cls, "architectures"
    from transformers.models.auto import modeling_auto  # the public mappings behind the Auto classes

    model_type = config.model_type
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    for task, mapping in TASKS:
        if task in ("sequence-to-sequence LM", "speech-to-text") and not encoder_decoder:
            continue
        if task == "masked LM" and getattr(config, "is_decoder", False):
            continue
        name = getattr(modeling_auto, mapping).get(model_type)
        name = name[0] if isinstance(name, tuple) else name
        cls = getattr(transformers, name, None) if name else None
        if isinstance(cls, type):
            return cls, task
    raise ModelError(f"hf:{path}: transformers {transformers.__version__} has no model class for `model_type` "
                     f"{model_type!r}; add `architectures` naming the class to build, or pass MODEL as "
                     "package.module:callable")


def _has_grouped_experts(cls: type) -> bool:
    can_set = getattr(cls, "_can_set_experts_implementation", None)
    try:
        return bool(can_set()) if callable(can_set) else False
    except Exception:  # noqa: BLE001 (a heuristic of transformers reading its own source)
        return False


def _example_inputs(cls: type, config: Any, batch: int, seq: int, path: str) -> tuple[Any, ...]:
    """One per-rank batch, by position in ``cls.forward``. See [Note: Hugging Face example inputs]."""
    params = inspect.signature(cls.forward).parameters
    g = torch.Generator().manual_seed(0)
    vocab = int(getattr(config, "vocab_size", None) or 1000)
    tokens = lambda n: torch.randint(0, vocab, (batch, n), generator=g)  # noqa: E731
    given: dict[str, Any] = {}
    if "input_features" in params:
        given["input_features"] = _speech_features(config, batch, g, path)
    elif "pixel_values" in params:
        size = getattr(config, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        given["pixel_values"] = torch.randn(batch, getattr(config, "num_channels", 3), h, w, generator=g)
    elif "input_ids" in params:
        given["input_ids"] = tokens(seq)
    else:
        wanted = ", ".join(n for n in list(params)[1:4])
        raise ModelError(f"hf:{path}: {cls.__name__} takes ({wanted}, ...); wrapopt makes example inputs of token ids, "
                         "pixel values and input features only: pass MODEL as package.module:callable returning "
                         "(model, example_inputs)")
    targets = given.get("input_ids")
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        dec_len = min(seq, int(getattr(config, "max_target_positions", None) or seq))
        targets = given["decoder_input_ids"] = tokens(dec_len)
        if "decoder_attention_mask" in params:
            given["decoder_attention_mask"] = torch.ones(batch, dec_len, dtype=torch.long)
    if "labels" in params:
        if "pixel_values" in given:
            num_labels = int(getattr(config, "num_labels", 2))
            given["labels"] = torch.randint(0, num_labels, (batch,), generator=g)
        elif targets is not None:
            given["labels"] = targets
    return _positional(params, given)


def _speech_features(config: Any, batch: int, g: torch.Generator, path: str) -> torch.Tensor:
    mels = getattr(config, "num_mel_bins", None)
    positions = getattr(config, "max_source_positions", None)
    if mels and positions:  # Whisper-like: two stride-2 convolutions reach max_source_positions
        return torch.randn(batch, int(mels), 2 * int(positions), generator=g)
    per_channel = getattr(config, "input_feat_per_channel", None)
    if per_channel:  # Speech2Text-like: (batch, frames, features)
        frames = 4 * int(getattr(config, "max_source_positions", 256) or 256)
        return torch.randn(batch, frames, int(per_channel) * int(getattr(config, "input_channels", 1)), generator=g)
    raise ModelError(f"hf:{path}: a speech model without `num_mel_bins` and `max_source_positions`; pass MODEL as "
                     "package.module:callable returning (model, example_inputs)")


def _positional(params: Any, given: dict[str, Any]) -> tuple[Any, ...]:
    """``given`` by position in ``forward``'s parameters (after self), defaults in between."""
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    missing = [n for n in given if n not in names]
    assert not missing, f"inputs {missing} are not positional parameters"  # internal invariant: taken from params
    last = max(names.index(n) for n in given)
    return tuple(given[n] if n in given else params[n].default for n in names[:last + 1])
