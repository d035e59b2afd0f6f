"""The model fingerprint and the names sharding wrappers add.

A plan records the fingerprint of the model it was made for, and every stage
that matches module names against a live model (apply, the FSDP1 policy, the
debug helpers) looks through the wrappers FSDP1, ``checkpoint_wrapper`` and
``torch.compile`` insert.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch.nn as nn

__all__ = ["model_fingerprint", "module_classes", "strip_wrapper_prefixes", "is_wrapper"]


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Class, parameter count, a hash of the sorted (name, shape, dtype) of
    every parameter (tied parameters under their first name), the table
    itself, and the module names under each module class.

    The classes let a plan name the modules that differ from another model
    and be exported as a class-based wrap policy (``wrapopt.interop``) without
    the model at hand. The hash covers the parameters only.
    """
    params = {n: (list(p.shape), str(p.dtype).replace("torch.", "")) for n, p in model.named_parameters()}
    text = json.dumps(sorted(params.items()))
    return {
        "class": type(model).__name__,
        "num_params": sum(p.numel() for p in model.parameters()),
        "hash": hashlib.sha256(text.encode()).hexdigest()[:16],
        "params": {n: {"shape": s, "dtype": d} for n, (s, d) in sorted(params.items())},
        "module_classes": module_classes(model),
    }


def module_classes(model: nn.Module) -> dict[str, list[str]]:
    """``{"package.module.Class": [module FQNs in named_modules() order]}``, sorted by class.

    The root counts under its own class; wrappers added by sharding
    (``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``) are looked through,
    so a sharded model reads like the model it was made from.
    """
    out: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        cls = type(m)
        if is_wrapper(cls):
            continue
        # fully_shard swaps a module's class for a subclass of (FSDPModule, cls): report cls.
        plain = [b for b in cls.__bases__ if b.__name__ != "FSDPModule"]
        if plain and len(plain) < len(cls.__bases__):
            cls = plain[0]
        out.setdefault(f"{cls.__module__}.{cls.__qualname__}", []).append(strip_wrapper_prefixes(name))
    return dict(sorted(out.items()))


# Module-name segments inserted by FSDP1 and checkpoint_wrapper around the wrapped module.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def strip_wrapper_prefixes(name: str) -> str:
    """``"layers.0._fsdp_wrapped_module.attn"`` -> ``"layers.0.attn"``."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


def is_wrapper(cls: type) -> bool:
    # FSDP1's FullyShardedDataParallel, checkpoint_wrapper's CheckpointWrapper, torch.compile's OptimizedModule:
    # each holds the real module under one of _WRAPPER_SEGMENTS and adds no parameters of its own.
    return cls.__name__ in ("FullyShardedDataParallel", "CheckpointWrapper", "OffloadWrapper", "OptimizedModule")
