"""A zoo entry (how to build a model, its example inputs, its loss) and the inputs and
losses the zoo's entries share (``zoo.py``, ``bench_models.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from wrapopt.checks import check_count

__all__ = ["ZooEntry", "lm_loss", "cls_loss", "tokens", "images", "src_tgt"]


def lm_loss(output: torch.Tensor, inputs: tuple[Any, ...]) -> torch.Tensor:
    """Next-token prediction on the input itself: targets are the last input shifted by one."""
    toks = inputs[-1]
    return F.cross_entropy(output[:, :-1].reshape(-1, output.shape[-1]).float(), toks[:, 1:].reshape(-1))


def cls_loss(output: torch.Tensor, inputs: tuple[Any, ...]) -> torch.Tensor:
    labels = torch.arange(output.shape[0], device=output.device) % output.shape[-1]
    return F.cross_entropy(output.float(), labels)


def tokens(vocab: int, seq: int) -> Callable[[int, torch.device], tuple[torch.Tensor, ...]]:
    def make(batch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1234)
        return (torch.randint(0, vocab, (batch, seq), generator=g).to(device),)

    return make


def images(image: int) -> Callable[[int, torch.device], tuple[torch.Tensor, ...]]:
    def make(batch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1234)
        return (torch.randn(batch, 3, image, image, generator=g).to(device),)

    return make


def src_tgt(vocab: int, seq: int) -> Callable[[int, torch.device], tuple[torch.Tensor, ...]]:
    def make(batch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1234)
        return (
            torch.randint(0, vocab, (batch, seq), generator=g).to(device),
            torch.randint(0, vocab, (batch, seq), generator=g).to(device),
        )

    return make


@dataclass(frozen=True, slots=True)
class ZooEntry:
    name: str
    description: str
    factory: Callable[[], nn.Module]
    make_inputs: Callable[[int, torch.device], tuple[Any, ...]]
    loss: Callable[[Any, tuple[Any, ...]], torch.Tensor]
    batch: int  # per-rank batch used by the demo, benchmarks and tracing
    trainable: bool  # small enough to run real steps on 2 CPU ranks
    # "zoo": the models the simulator and search were tuned on; "bench": the wider bench set
    # (bench_models.py), built differently, which checks that plans hold on models wrapopt was
    # not built around.
    suite: str = "zoo"

    def build(self, device: str | torch.device = "cpu", *, seed: int = 0) -> nn.Module:
        """Build the model; on ``meta`` no weights are allocated."""
        device = torch.device(device)
        if device.type != "meta":
            torch.manual_seed(seed)
        # Planning-only shapes are built in bfloat16, as such models are trained.
        dtype = torch.float32 if self.trainable else torch.bfloat16
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with device:
                model = self.factory()
        finally:
            torch.set_default_dtype(old)
        return model

    def inputs(self, batch: int | None = None, device: str | torch.device = "cpu") -> tuple[Any, ...]:
        """One per-rank batch of example inputs: ``batch`` rows (default ``self.batch``; 0 is refused,
        not replaced by the default)."""
        batch = self.batch if batch is None else check_count(batch, f"the batch of zoo:{self.name} (--batch)")
        return self.make_inputs(batch, torch.device(device))
