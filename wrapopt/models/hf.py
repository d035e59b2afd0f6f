"""``hf:config.json``: Hugging Face models built from their config, on any device (meta included)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from wrapopt.errors import ModelError
from wrapopt.fileio import read_json
from wrapopt.models.base import ModelSource

__all__ = ["hf_source"]


def hf_source(path: str, batch: int | None, seq: int | None) -> ModelSource:
    """``hf:path/to/config.json``: a Hugging Face model built from its config (no weights)."""
    batch, seq = batch or 1, seq or 128
    if not os.path.isfile(path):
        raise ModelError(f"hf:{path}: no such config file (give the path to a config.json)")
    try:
        import transformers
    except ImportError:
        raise ModelError("hf: models need transformers: pip install 'wrapopt[hf]'") from None
    cfg_dict = read_json(path, error=ModelError)
    if not isinstance(cfg_dict, dict):
        raise ModelError(f"hf:{path}: a config file is a JSON object, got {type(cfg_dict).__name__}")
    try:
        config = transformers.AutoConfig.for_model(**cfg_dict)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelError(f"hf:{path}: not a usable Hugging Face config ({e})") from None
    vocab = getattr(config, "vocab_size", 1000)
    is_vit = getattr(config, "model_type", "") in ("vit", "deit")
    is_enc_dec = bool(getattr(config, "is_encoder_decoder", False))

    def build(device: str) -> nn.Module:
        torch.manual_seed(0)
        with torch.device(device):
            if is_vit:
                return transformers.AutoModelForImageClassification.from_config(config)
            if is_enc_dec:
                return transformers.AutoModelForSeq2SeqLM.from_config(config)
            try:
                return transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:
                return transformers.AutoModel.from_config(config)

    g = torch.Generator().manual_seed(0)
    if is_vit:
        size = getattr(config, "image_size", 224)
        inputs: tuple[Any, ...] = (torch.randn(batch, getattr(config, "num_channels", 3), size, size, generator=g),)
    else:
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        inputs = (ids, None, ids) if is_enc_dec else (ids,)
    return ModelSource(f"hf:{path}", build, inputs, None, False)
