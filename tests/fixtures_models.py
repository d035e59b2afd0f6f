"""Tiny fixture models for the tracer, plan and CLI tests.

Importable (``tests.fixtures_models:make_mlp`` is a CLI ``MODEL``), cheap to
build on CPU or meta, and each one exercises one case the tracer must handle:

- ``MLPStack``: a plain stack of linear blocks in a Sequential.
- ``AlbertLike``: one layer called ``num_repeats`` times (weight sharing across depth).
- ``LoRAModel``: a frozen base with trainable low-rank adapters.
- ``MoEModel``: a mixture-of-experts block with top-1 routing by a fixed gate.
- ``WithUnused``: a submodule that forward never calls.
- ``ItemInForward``: a data-dependent ``.item()`` in one submodule's forward.
- ``NoParams``: no parameters at all.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM = 16
BATCH = 4


class MLPBlock(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class MLPStack(nn.Module):
    def __init__(self, dim: int = DIM, num_blocks: int = 3):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.Sequential(*(MLPBlock(dim) for _ in range(num_blocks)))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def make_mlp() -> tuple[nn.Module, torch.Tensor]:
    """``(model, example_inputs)``: the form a ``package.module:callable`` MODEL returns."""
    return MLPStack(), torch.randn(BATCH, DIM)


class AlbertLike(nn.Module):
    """ALBERT-style: one transformer-ish layer whose weights serve every depth."""

    def __init__(self, dim: int = DIM, num_repeats: int = 3):
        super().__init__()
        self.num_repeats = num_repeats
        self.embed = nn.Linear(dim, dim)
        self.layer = MLPBlock(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for _ in range(self.num_repeats):
            x = self.layer(x)
        return self.head(x)


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable rank-``rank`` update ``B @ A``."""

    def __init__(self, dim_in: int, dim_out: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(dim_in, dim_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim_in) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(dim_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class LoRAModel(nn.Module):
    def __init__(self, dim: int = DIM, rank: int = 2):
        super().__init__()
        self.l1 = LoRALinear(dim, dim, rank)
        self.l2 = LoRALinear(dim, dim, rank)
        self.frozen_head = nn.Linear(dim, dim)
        self.frozen_head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen_head(F.relu(self.l2(F.relu(self.l1(x)))))


class MoEBlock(nn.Module):
    """Top-1 routing: each token goes to the expert with the largest gate logit.

    ``dense=False`` gathers each expert's tokens with a boolean mask (a
    data-dependent shape: it cannot run on meta tensors); ``dense=True`` runs
    every expert on every token and keeps the chosen one with a one-hot mask
    (same result, shapes known in advance).
    """

    def __init__(self, dim: int = DIM, num_experts: int = 4, *, dense: bool = False):
        super().__init__()
        self.dense = dense
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(MLPBlock(dim) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.gate(x).argmax(dim=-1)
        if self.dense:
            onehot = F.one_hot(choice, len(self.experts)).to(x.dtype)
            return sum(onehot[..., e : e + 1] * expert(x) for e, expert in enumerate(self.experts))
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            out[mask] = expert(x[mask])  # data-dependent shape: needs real values
        return out


class MoEModel(nn.Module):
    def __init__(self, dim: int = DIM, num_experts: int = 4, *, dense: bool = False):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.moe = MoEBlock(dim, num_experts, dense=dense)
        self.out = nn.Linear(dim, dim)
        with torch.no_grad():
            # A fixed gate: expert e sees the tokens whose largest feature among
            # the first num_experts is feature e.
            if not self.moe.gate.weight.is_meta:
                self.moe.gate.weight.zero_()
                self.moe.gate.weight[:, :num_experts] = torch.eye(num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x)))


def moe_inputs(dim: int = DIM, num_tokens: int = 16) -> torch.Tensor:
    return torch.randn(num_tokens, dim, generator=torch.Generator().manual_seed(0))


class WithUnused(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.used = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class ScaleByMax(nn.Module):
    """Reads a value out of the tensor with ``.item()``: a data-dependent op."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        peak = x.abs().max().item()
        return self.proj(x) / (1.0 + peak)


class ItemInForward(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.scaler = ScaleByMax(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaler(self.inp(x))


class NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)
