"""Models already wrapped or sharded, refused by the stages that want the plain model.

The tracer reads a model's own modules and parameters, and ``apply_plan`` calls
``fully_shard`` on them: a model that ``fully_shard`` (FSDP2), FSDP1's
``FullyShardedDataParallel``, ``parallelize_module`` or ``distribute_module``
already went through holds other modules (``FSDP<Class>``, a wrapper) or DTensor
parameters, and would fail deep inside torch. Each is refused in one line that
says to pass the unwrapped model. The classes are recognised by name along their
MRO, so that this module imports nothing from ``torch.distributed`` (absent from
some builds).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from wrapopt.errors import ModelError

__all__ = ["check_unwrapped"]


def _is(obj: Any, class_name: str) -> bool:
    return any(c.__name__ == class_name for c in type(obj).__mro__)


def check_unwrapped(model: nn.Module, stage: str, *, error: type[Exception] = ModelError) -> None:
    """``error`` (one line: what wrapped the model, where, and to pass the unwrapped model)
    when FSDP2, FSDP1 or tensor parallelism already ran on ``model``; ``stage`` names the
    caller ("trace", "apply") in the message."""
    modules = list(model.named_modules())
    sharded = [n or "<root>" for n, m in modules if _is(m, "FSDPModule")]
    if sharded:
        raise error(f"{stage}: the model is already sharded (fully_shard was applied to {', '.join(sharded[:4])}, "
                    f"its class is now {type(model).__name__}); pass the unwrapped model: build a fresh one")
    wrapped = [n or "<root>" for n, m in modules if _is(m, "FullyShardedDataParallel")]
    if wrapped:
        raise error(f"{stage}: the model is already wrapped by FSDP1 (FullyShardedDataParallel at "
                    f"{', '.join(wrapped[:4])}); pass the unwrapped model (a fresh one, or the module given to FSDP)")
    distributed = next((n for n, p in model.named_parameters() if _is(p, "DTensor")), None)
    if distributed is not None:
        raise error(f"{stage}: the model's parameters are already distributed ({distributed} is a DTensor: "
                    "parallelize_module or distribute_module ran); pass the unwrapped model with plain parameters")
