"""Losses wrapopt assumes when the user gives none.

Shared by the tracer (what the loss saves for backward), the device
measurement (the loss's time) and the zoo's models.
"""

from __future__ import annotations

from typing import Any

import torch

from wrapopt.errors import ModelError

__all__ = ["default_loss"]


def default_loss(output: Any, inputs: tuple[Any, ...] = ()) -> torch.Tensor:
    """A loss for models without one: mean square of every floating output.

    Deterministic and cheap; what matters for planning and parity tests is that
    backward runs through every parameter that took part in forward.
    """
    tensors = _float_tensors(output)
    if not tensors:
        raise ModelError("the model's output holds no floating-point tensor to back-propagate from; pass loss_fn=")
    return sum(t.float().pow(2).mean() for t in tensors)  # type: ignore[return-value]


def _float_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, dict) or hasattr(obj, "values") and callable(obj.values):
        return [t for v in obj.values() for t in _float_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _float_tensors(v)]
    return []
