"""``package.module:callable`` model sources that go wrong, for the reliability suite."""

from __future__ import annotations

import torch.nn as nn


def raises() -> nn.Module:
    raise RuntimeError("the weights file is missing")


def returns_a_list() -> list[int]:
    return [1, 2]


def no_inputs() -> nn.Module:
    return nn.Linear(4, 4)


NOT_CALLABLE = 3
