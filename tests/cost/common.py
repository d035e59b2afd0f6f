"""Helpers shared by the cost tests."""

from __future__ import annotations

import random


class UniformChoices:
    """A random source for ``SearchSpace.decode``: every choice uniform."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def cat(self, name, choices):
        return self.rng.choice(choices)
