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
of the modality the class's ``forward`` takes, sized from the config: token ids
(``input_ids``: ``--seq`` tokens, an error past the model's positions, 128 or
fewer without it, ``--seq context`` for all of them), images (``pixel_values``
of the config's ``image_size`` and ``num_channels``, read from
``vision_config`` when nested, as CLIP's are; CLIP gets its text beside them
and ``return_loss``), raw audio (``input_values``: ``--seq`` encoder frames of
the product of ``conv_stride`` samples each, for Wav2Vec2-like encoders, with
a CTC transcript a quarter of the frames long as ``labels``) or log-mel
features (``input_features``, Whisper's fixed 30 s window), plus decoder token
ids for encoder-decoders and ``labels`` wherever ``forward`` takes them, so
the model computes the loss it trains with. A ``forward`` needing anything
else is refused naming the input and the way to supply it. SpecAugment (the
random time masks of Wav2Vec2-like encoders) is off on meta: it indexes with a
boolean mask, whose size meta tensors cannot know; it costs one elementwise
write, and real steps keep it. ``use_cache`` keeps the config's value, as in a training loop
that does not set it. They are passed by position in ``forward``'s order (its defaults in between), so a
plain ``model(*inputs)`` runs them. Encoder-decoders also get a
``decoder_attention_mask`` of ones: BART's decoder would otherwise build one
on the model's (meta) device and read it with ``.item()``; given as an
integer input, the tracer keeps it real (See [Note: integer inputs stay
real] in trace/meta.py).

[Note: stored dtype is not the training dtype] A config's ``torch_dtype``
(``dtype`` in transformers 5), "bfloat16" in nearly every released config,
says how the checkpoint's weights were saved. ``from_pretrained`` and
``_from_config`` build the model in it, but training under FSDP2 keeps fp32
master weights: the model is built in float32 and a bf16
``MixedPrecisionPolicy`` (``--precision bf16``) casts the gathered copies and
the compute, while the sharded parameters, their gradients and the optimizer
state stay float32 (as TorchTitan and Accelerate train). The model is
therefore always built in float32 here, and the source's notes say so.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
from typing import Any

import torch
import torch.nn as nn

from wrapopt.checks import check_count
from wrapopt.errors import ModelError
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


def hf_source(path: str, batch: int | None, seq: int | str | None) -> ModelSource:
    """``hf:path/to/config.json`` (or ``hf:path/to/folder`` holding one): a Hugging Face model built
    from its config (no weights)."""
    # seq: tokens (or audio frames); None: 128, within the model's positions; "context": all.
    # A given batch or seq is checked, never replaced (See [Note: numbers where they enter] in checks.py).
    batch = 1 if batch is None else check_count(batch, f"the batch of hf:{path} (--batch)")
    if isinstance(seq, int):
        check_count(seq, "--seq")
    if os.path.isdir(path):  # a model folder, as transformers' from_pretrained takes it
        folder, path = path, os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ModelError(f"hf:{folder}: the folder holds no config.json (give a folder with one, or the path "
                             "to a config file)")
    if not os.path.isfile(path):
        raise ModelError(f"hf:{path}: no such config file (give the path to a config.json, or a folder holding one)")
    with _quiet_optional_imports():
        return _hf_source(path, batch, seq)


# [Note: quiet optional imports] transformers imports torchao, where it is installed (the float8
# extra), the first time a model class is looked up; torchao's import logs a warning per CUDA
# kernel library a CPU build cannot load, and torch's pytree logs one per Enum it registers.
# None concerns the user's model, so those loggers are held at ERROR while a model is read
# and built (only where the user has set no level of their own), then restored.
_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def _quiet_optional_imports():
    loggers = [logging.getLogger(name) for name in _IMPORT_LOGGERS]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        if lg.level == logging.NOTSET:
            lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, before):
            lg.setLevel(level)


def _hf_source(path: str, batch: int | None, seq: int | str | None) -> ModelSource:
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
    warnings = check_config_fields(cfg_dict, f"hf:{path}")
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
        kwargs: dict[str, Any] = {"dtype": torch.float32}  # See [Note: stored dtype is not the training dtype]
        if torch.device(device).type == "cpu" and _has_grouped_experts(cls):
            # The CPU grouped-matmul kernel has no float32 backward; on meta the tracer runs it
            # (See [Note: experts on meta] in trace/ops.py), as GPUs do.
            kwargs["experts_implementation"] = "eager"
        cfg = copy.deepcopy(config)  # a copy: transformers writes the experts implementation into the config
        if torch.device(device).type == "meta" and getattr(cfg, "apply_spec_augment", False):
            cfg.apply_spec_augment = False  # See [Note: Hugging Face example inputs]: SpecAugment on meta
        with torch.device(device):
            return cls._from_config(cfg, **kwargs)

    try:
        model = build("meta")
    except Exception as e:  # noqa: BLE001 (transformers' own error, translated: See check_config_fields)
        raise ModelError(f"hf:{path}: building {cls.__name__} from this config failed ({type(e).__name__}: "
                         f"{_last_line(e)}); fix the config's fields, or pass MODEL as package.module:callable") from e
    inputs = _example_inputs(cls, config, batch, seq, path)
    small = sum(p.numel() for p in model.parameters()) <= _TRAINABLE_MAX_PARAMS
    return ModelSource(f"hf:{path}", build, inputs, None, small, notes=(*warnings, *_dtype_notes(cfg_dict)))


def _dtype_notes(cfg: dict[str, Any]) -> tuple[str, ...]:
    """Say that the config's stored dtype was not taken as the training dtype.
    See [Note: stored dtype is not the training dtype]."""
    stored = cfg.get("dtype") or cfg.get("torch_dtype")
    if not isinstance(stored, str) or stored in ("float32", "auto"):
        return ()
    return (f"the config's stored dtype ({stored}) is how its weights were saved, not the training dtype: the model "
            "is built in float32 (master weights, gradients and optimizer state); --precision bf16 computes in "
            "bfloat16; --master-dtype bfloat16 trains in pure bf16",)


# Fields that, when a config has them, count something: positive integers.
_SIZES = ("vocab_size", "hidden_size", "n_embd", "d_model", "dim", "intermediate_size", "ffn_dim", "d_ff", "n_inner",
          "encoder_ffn_dim", "decoder_ffn_dim", "num_hidden_layers", "n_layer", "num_layers", "n_layers",
          "encoder_layers", "decoder_layers", "num_attention_heads", "n_head", "n_heads", "num_heads",
          "encoder_attention_heads", "decoder_attention_heads", "num_key_value_heads", "head_dim", "d_kv",
          "max_position_embeddings", "n_positions")
# (width field, heads field): the heads split the width, unless the config sets ``head_dim`` itself.
_WIDTH_HEADS = (("hidden_size", "num_attention_heads"), ("n_embd", "n_head"), ("d_model", "encoder_attention_heads"),
                ("d_model", "decoder_attention_heads"), ("dim", "n_heads"))
# Token ids the model itself indexes with (an embedding's padding row; the first decoder input of an
# encoder-decoder): one outside the vocabulary breaks the build or the forward, so it is refused.
_TOKEN_IDS = ("pad_token_id", "decoder_start_token_id")
# Token ids only generation and data pipelines read: outside the vocabulary they are a warning, as
# transformers gives (GPT-2, OLMo 2, Phi-3 or StarCoder2 configs with a shrunken vocabulary train).
_SPECIAL_IDS = ("bos_token_id", "eos_token_id")


def check_config_fields(cfg: dict[str, Any], where: str) -> tuple[str, ...]:
    """``ModelError`` naming ``where`` (the config file), the field and the fix when a size is not a
    positive integer, the attention heads do not split the width (or the key-value heads the
    heads), or a token id the model indexes with lies outside the vocabulary: checked before
    transformers builds anything. Returns warnings: special token ids (bos, eos) outside it."""
    positive = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
    for name in _SIZES:
        v = cfg.get(name)  # a list: one per stage (Swin's num_heads)
        if v is not None and not (positive(v) or (isinstance(v, list) and v and all(map(positive, v)))):
            raise ModelError(f"{where}: field `{name}` must be a positive integer, got {v!r}; "
                             f"write a number without quotes, e.g. \"{name}\": 64")
    for width, heads in _WIDTH_HEADS:
        w, h = cfg.get(width), cfg.get(heads)
        if positive(w) and positive(h) and cfg.get("head_dim") is None and w % h:
            raise ModelError(f"{where}: field `{heads}` = {h} does not divide `{width}` = {w} (each head gets "
                             f"{width} / {heads} features); give a number of heads that divides {w}")
    h, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if h and kv and h % kv:
        raise ModelError(f"{where}: field `num_key_value_heads` = {kv} does not divide `num_attention_heads` = {h}; "
                         f"give a divisor of {h} (each key-value head serves a group of query heads)")
    vocab = cfg.get("vocab_size")
    warnings = []
    for name in (*_TOKEN_IDS, *_SPECIAL_IDS):
        ids = cfg.get(name)
        for i in ids if isinstance(ids, list) else [ids]:
            if i is None or (isinstance(i, int) and not isinstance(i, bool) and (vocab is None or 0 <= i < vocab)):
                continue
            within = f"0 to {vocab - 1}" if vocab else "0 or more"
            if name in _SPECIAL_IDS and isinstance(i, int) and not isinstance(i, bool):
                warnings.append(f"{where}: field `{name}` = {i} is outside the vocabulary (`vocab_size` = {vocab}); "
                                "the model never indexes with it (generation and data pipelines do), so it is "
                                "planned as given")
                continue
            raise ModelError(f"{where}: field `{name}` = {i!r} is outside the vocabulary (`vocab_size` = {vocab}); "
                             f"give a token id from {within}, or null")
    return tuple(warnings)


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


# What ``_example_inputs`` can make, by the name ``forward`` gives it.
_MADE = ("input_ids", "pixel_values", "input_values", "input_features")


def _sub(config: Any, field: str, *subs: str) -> Any:
    """``config.field``, else the first nested config's (``vision_config``, ``text_config``) that has it."""
    value = getattr(config, field, None)
    for sub in subs:
        if value is not None:
            break
        value = getattr(getattr(config, sub, None), field, None)
    return value


def _example_inputs(cls: type, config: Any, batch: int, seq: int | str | None, path: str) -> tuple[Any, ...]:
    """One per-rank batch, by position in ``cls.forward``. See [Note: Hugging Face example inputs]."""
    params = inspect.signature(cls.forward).parameters
    g = torch.Generator().manual_seed(0)
    vocab = int(_sub(config, "vocab_size", "text_config") or 1000)
    tokens = lambda n: torch.randint(0, vocab, (batch, n), generator=g)  # noqa: E731
    given: dict[str, Any] = {}
    if "input_features" in params:
        given["input_features"] = _speech_features(config, batch, g, path)
    elif "input_values" in params:
        given["input_values"] = _audio(config, batch, seq, g)
    elif "pixel_values" in params:
        size = _sub(config, "image_size", "vision_config") or 224
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        channels = int(_sub(config, "num_channels", "vision_config") or 3)
        given["pixel_values"] = torch.randn(batch, channels, h, w, generator=g)
    if "input_ids" in params and (not given or getattr(config, "text_config", None) is not None):
        given["input_ids"] = tokens(_text_length(config, seq, path))  # a token model, or text beside images (CLIP)
    if not given:
        raise ModelError(_cannot_make(cls, params, path))
    targets = given.get("input_ids")
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        dec_len = min(_text_length(config, seq, path), int(getattr(config, "max_target_positions", None) or 1 << 30))
        targets = given["decoder_input_ids"] = tokens(dec_len)
        if "decoder_attention_mask" in params:
            given["decoder_attention_mask"] = torch.ones(batch, dec_len, dtype=torch.long)
    if "return_loss" in params:
        given["return_loss"] = True  # CLIP's contrastive loss
    elif "labels" in params:
        if "input_values" in given:  # CTC: a transcript shorter than the encoder's frames, no blank (pad) token
            pad = int(getattr(config, "pad_token_id", 0) or 0)
            frames = _audio_frames(config, seq)
            ids = torch.randint(0, vocab - 1, (batch, max(1, frames // 4)), generator=g)
            given["labels"] = ids + (ids >= pad).long()
        elif "pixel_values" in given:
            num_labels = int(getattr(config, "num_labels", 2))
            given["labels"] = torch.randint(0, num_labels, (batch,), generator=g)
        elif targets is not None:
            given["labels"] = targets
    return _positional(params, given)


def _text_length(config: Any, seq: int | str | None, path: str) -> int:
    """``seq`` tokens, within the model's positions; ``"context"``: all of them; None: 128 or fewer."""
    field = next((f for f in _POSITIONS if _sub(config, f, "text_config")), None)
    limit = int(_sub(config, field, "text_config")) if field else None
    if seq == "context":
        if limit is None:
            raise ModelError(f"hf:{path}: the config states no context length ({', '.join(_POSITIONS)}); "
                             "give --seq N")
        return limit
    if seq is None:
        return min(_DEFAULT_SEQ, limit or _DEFAULT_SEQ)
    if limit is not None and int(seq) > limit:
        raise ModelError(f"hf:{path}: --seq {seq} is beyond the model's positions (`{field}` = {limit}); "
                         f"give --seq {limit} or less (--seq context uses all {limit})")
    return int(seq)


_DEFAULT_SEQ = 128  # tokens (or audio frames) when --seq is not given
# Fields that state how many positions a token model has, in the order they are read.
_POSITIONS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def _audio_stride(config: Any) -> int:
    """Raw samples per encoder frame: the product of the feature extractor's conv strides."""
    stride = 1
    for s in getattr(config, "conv_stride", None) or (320,):
        stride *= int(s)
    return stride


def _audio_frames(config: Any, seq: int | str | None) -> int:
    """Encoder frames: ``seq``, 128 without it, ``"context"``: one second at the config's
    ``sampling_rate`` (16 kHz when it states none)."""
    if seq == "context":
        return max(1, int(getattr(config, "sampling_rate", None) or 16000) // _audio_stride(config))
    return int(seq or _DEFAULT_SEQ)


def _audio(config: Any, batch: int, seq: int | str | None, g: torch.Generator) -> torch.Tensor:
    """Raw audio (``input_values``) giving ``_audio_frames`` encoder frames."""
    stride = _audio_stride(config)
    samples = _audio_frames(config, seq) * stride
    receptive = sum(int(k) - 1 for k in getattr(config, "conv_kernel", None) or ()) * stride // 2
    return torch.randn(batch, samples + receptive, generator=g)


def _cannot_make(cls: type, params: Any, path: str) -> str:
    needed = [n for n, p in list(params.items())[1:] if p.default is p.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)] or [n for n in list(params)[1:2]]
    return (f"hf:{path}: {cls.__name__}.forward needs `{needed[0]}`, which wrapopt cannot make from a config (it makes "
            f"{', '.join(_MADE)}); pass MODEL as package.module:callable returning (model, example_inputs), e.g. "
            f"mypkg.models:build returning ({cls.__name__}._from_config(config), ({needed[0]}, ...))")


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
