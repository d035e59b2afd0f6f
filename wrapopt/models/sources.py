"""``MODEL`` arguments of the CLI: ``zoo:NAME``, ``package.module:callable``, ``hf:config.json``.

Each resolves to a ``ModelSource``: how to build the model (on any device,
meta included), example inputs for one per-rank batch, and a loss.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from wrapopt.errors import ModelError
from wrapopt.fileio import read_json
from wrapopt.models import zoo

__all__ = ["ModelSource", "resolve_model"]


@dataclass(frozen=True)
class ModelSource:
    name: str
    build: Callable[[str], nn.Module]  # device -> model (seeded, deterministic)
    inputs: tuple[Any, ...]
    loss: Callable[[Any, tuple], torch.Tensor] | None
    trainable_here: bool  # small enough to run real steps on this machine


def resolve_model(spec: str, *, batch: int | None = None, seq: int | None = None) -> ModelSource:
    """Turn a CLI ``MODEL`` string into a ``ModelSource``; errors say what is accepted."""
    if spec.startswith("zoo:"):
        entry = zoo.get_entry(spec[4:])
        inputs = entry.inputs(batch)
        if seq is not None:
            inputs = tuple(x[:, :seq] if x.dim() == 2 else x for x in inputs)
        return ModelSource(spec, lambda device: entry.build(device if entry.trainable else "meta"), inputs,
                           entry.loss, entry.trainable)
    if spec.startswith("hf:"):
        return _hf(spec[3:], batch or 1, seq or 128)
    if ":" in spec:
        return _callable(spec)
    raise ModelError(
        f"cannot read MODEL {spec!r}: use zoo:NAME (see `wrapopt trace --list`), package.module:callable, "
        "or hf:path/to/config.json"
    )


def _callable(spec: str) -> ModelSource:
    mod_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ModelError(f"cannot import {mod_name!r} for MODEL {spec!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelError(f"{mod_name!r} has no callable {attr!r}; MODEL must name a function returning a model")
    probe = fn()
    model, inputs = (probe if isinstance(probe, tuple) else (probe, None))
    if not isinstance(model, nn.Module):
        raise ModelError(f"{spec} returned {type(model).__name__}, not an nn.Module (or (module, example_inputs))")
    if inputs is None:
        raise ModelError(f"{spec} returned a model without example inputs; return (model, example_inputs)")
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)

    def build(device: str) -> nn.Module:
        torch.manual_seed(0)
        with torch.device(device):
            out = fn()
        return out[0] if isinstance(out, tuple) else out

    return ModelSource(spec, build, inputs, None, True)


def _hf(path: str, batch: int, seq: int) -> ModelSource:
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
