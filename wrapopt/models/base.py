"""What a model source gives: how to build the model, example inputs, a loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

__all__ = ["ModelSource"]


@dataclass(frozen=True)
class ModelSource:
    name: str
    build: Callable[[str], nn.Module]  # device -> model (seeded, deterministic)
    inputs: tuple[Any, ...]
    loss: Callable[[Any, tuple], torch.Tensor] | None
    trainable_here: bool  # small enough to run real steps on this machine
    notes: tuple[str, ...] = ()  # what the source decided for the user (e.g. the dtype it built in), for reports
