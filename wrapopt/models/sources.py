"""``MODEL`` arguments of the CLI: ``zoo:NAME``, ``hf:config.json``, ``package.module:callable``.

Each resolves to a ``ModelSource``: how to build the model (on any device,
meta included), example inputs for one per-rank batch, and a loss. Sources
with a prefix (``zoo:``, ``hf:``) are looked up in ``SOURCES``; a new one is
one function and one ``register_source`` call. A string with a colon and no
registered prefix is ``package.module:callable``.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Callable

import torch
import torch.nn as nn

from wrapopt.checks import check_count
from wrapopt.errors import ModelError, OptionError
from wrapopt.models import zoo
from wrapopt.models.base import ModelSource
from wrapopt.models.hf import hf_source
from wrapopt.train import TORCH_DTYPES

__all__ = ["ModelSource", "SourceFn", "SOURCES", "register_source", "resolve_model", "with_master_dtype"]


# (the text after the prefix, per-rank batch or None, sequence length or None) -> ModelSource
SourceFn = Callable[[str, "int | None", "int | None"], ModelSource]
SOURCES: dict[str, SourceFn] = {}


def register_source(prefix: str, fn: SourceFn) -> None:
    """Make ``PREFIX:...`` a ``MODEL`` string; ``fn`` gets the text after the colon."""
    if not prefix.isidentifier():
        raise ValueError(f"a model source prefix is a word such as 'zoo', got {prefix!r}")
    SOURCES[prefix] = fn


def resolve_model(spec: str, *, batch: int | None = None, seq: int | str | None = None) -> ModelSource:
    """Turn a CLI ``MODEL`` string into a ``ModelSource``; errors say what is accepted."""
    prefix, colon, rest = spec.partition(":")
    if prefix in SOURCES:
        return SOURCES[prefix](rest, batch, seq)
    if colon:
        return _callable(spec)
    raise ModelError(
        f"cannot read MODEL {spec!r}: use " + ", ".join(f"{p}:..." for p in SOURCES)
        + " (zoo:NAME, see `wrapopt trace --list`; hf:path/to/config.json), or package.module:callable"
    )


def with_master_dtype(src: ModelSource, dtype: str | None) -> ModelSource:
    """``src`` whose model is cast to ``dtype`` (a ``TORCH_DTYPES`` name; None: as built) once
    built: the master weights, gradients and optimizer state of pure low-precision training
    (``--master-dtype``). Only floating parameters and buffers are cast, as ``Module.to`` does."""
    if dtype is None or dtype == "float32":
        return src
    if dtype not in TORCH_DTYPES:
        raise ModelError(f"unknown master dtype {dtype!r}; accepted: {', '.join(TORCH_DTYPES)}")
    build, torch_dtype = src.build, TORCH_DTYPES[dtype]
    keep = tuple(n for n in src.notes if "is built in float32" not in n)  # no longer true
    note = (f"master weights, gradients and optimizer state in {dtype} (--master-dtype): pure {dtype} training, the "
            f"model cast with model.to(torch.{dtype}) before sharding; apply the plan to a model cast the same way")
    return replace(src, build=lambda device: build(device).to(torch_dtype), notes=(*keep, note))


def _zoo(name: str, batch: int | None, seq: int | str | None) -> ModelSource:
    entry = zoo.get_entry(name)
    inputs = entry.inputs(batch)
    if isinstance(seq, int):  # "context": the zoo entry's own length
        inputs = _cut_to_seq(f"zoo:{name}", inputs, check_count(seq, "--seq"))
    return ModelSource(f"zoo:{name}", lambda device: entry.build(device if entry.trainable else "meta"), inputs,
                       entry.loss, entry.trainable)


def _cut_to_seq(name: str, inputs: tuple, seq: int) -> tuple:
    """A zoo model's token inputs cut to ``seq``; its own length is its limit: ``--seq`` past it, or
    for a model that takes no token sequence, is an error, not a value quietly cut or dropped."""
    lengths = {x.shape[1] for x in inputs if isinstance(x, torch.Tensor) and x.dim() == 2}
    if not lengths:
        raise OptionError(f"--seq does not apply to {name}: it takes no token sequence; drop --seq")
    limit = min(lengths)
    if seq > limit:
        raise OptionError(f"--seq {seq} is past {name}'s limit of {limit} tokens; give --seq {limit} or less")
    return tuple(x[:, :seq] if isinstance(x, torch.Tensor) and x.dim() == 2 else x for x in inputs)


def _callable(spec: str) -> ModelSource:
    mod_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ModelError(f"cannot import {mod_name!r} for MODEL {spec!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 (the user's module failed while importing)
        raise ModelError(f"MODEL {spec}: importing {mod_name!r} raised {type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else '(no message)'}; "
                         "fix the module so that it imports") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelError(f"{mod_name!r} has no callable {attr!r}; MODEL must name a function returning a model")
    probe = _call(fn, spec)
    model, inputs = (probe if isinstance(probe, tuple) else (probe, None))
    if not isinstance(model, nn.Module):
        raise ModelError(f"{spec} returned {type(model).__name__}, not an nn.Module (or (module, example_inputs))")
    if inputs is None:
        raise ModelError(f"{spec} returned a model without example inputs; return (model, example_inputs)")
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)

    def build(device: str) -> nn.Module:
        torch.manual_seed(0)
        with torch.device(device):
            out = _call(fn, spec)
        return out[0] if isinstance(out, tuple) else out

    return ModelSource(spec, build, inputs, None, True)


def _call(fn: Callable[[], object], spec: str) -> object:
    """``fn()``; an exception it raises becomes one line naming the callable, the error and the fix."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (the user's code: any error is theirs to fix)
        text = str(e).strip().splitlines()[0][:300] if str(e).strip() else "(no message)"
        raise ModelError(f"MODEL {spec}: calling {spec.replace(':', '.', 1)}() raised {type(e).__name__}: {text}; "
                         "fix the callable so that, called with no arguments, it returns (model, example_inputs)"
                         ) from e


register_source("zoo", _zoo)
register_source("hf", hf_source)
