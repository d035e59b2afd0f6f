"""``train_step``: one optimizer step over micro-batches, the way a plan was scored.

With ``grad_accumulation = k`` the step runs k forward-backward passes, each
on one micro-batch with its loss divided by k (so the gradients are those of
the mean loss over the k micro-batches: one batch k times the size when the
loss is a mean over equal micro-batches), then one optimizer step. In the
``last`` sync mode every micro-batch but the last runs under
``set_requires_gradient_sync(False)``: no reduce-scatter, the unsharded
gradients accumulate; the last synchronises them. In ``every`` mode each
micro-batch reduce-scatters. See [Note: accumulation sync] in
``cost/simulate.py`` for what each costs.

Under a 2-D plan (``plan.mesh.tp_size > 1``) every rank of one tensor-parallel
group must step on the same micro-batches: pick each rank's share of the global
batch by its data-parallel rank, ``dp_rank, dp_size =
wrapopt.launch.dp_rank_size(plan.mesh)``, not by its global rank (See [Note:
applying a 2-D plan] in ``plan/tp.py``).

A plan applied with the float8 all-gather (``train.float8_all_gather``) needs the weights'
scales computed after each optimizer step: ``train_step`` calls
``wrapopt.plan.float8.after_optimizer_step(model)``; a loop of the user's own must call it after
``optimizer.step()`` (See [Note: applying float8] in ``plan/float8.py``).

Under context parallelism (``plan.mesh.cp_size > 1``) each micro-batch runs inside
``plan.train_context``: its tensors are sharded on their sequence dims (``seq_dims``, default 1:
(batch, seq) input ids and labels, labels shifted ahead of time: a loss that shifts inside
would pair tokens across the cut) together with ``cp_buffers`` ((tensor, seq dim) pairs such as
``(model.freqs_cis, 0)``), restored after; the loss returned is averaged over the cp ranks. See
[Note: applying context parallelism] in ``plan/cp.py``.

Example:
    >>> plan = WrapPlan.load("plan.json")  # doctest: +SKIP
    >>> model = plan.apply(model)  # doctest: +SKIP
    >>> dp_rank, dp_size = dp_rank_size(plan.mesh)  # doctest: +SKIP
    >>> micro_batches = [b.chunk(dp_size)[dp_rank] for b in global_batches]  # doctest: +SKIP
    >>> opt = plan.train_config.make_optimizer(model.parameters(), lr=3e-4)  # doctest: +SKIP
    >>> loss = train_step(model, opt, micro_batches, loss_fn, plan=plan)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.losses import scalar_loss
from wrapopt.plan.cp import cp_mesh_of
from wrapopt.plan.file import WrapPlan
from wrapopt.plan.float8 import after_optimizer_step
from wrapopt.train import TrainConfig

__all__ = ["train_step"]


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[tuple[Any, ...] | Any],
    loss_fn: Callable[[Any, tuple[Any, ...]], torch.Tensor],
    *,
    plan: WrapPlan | None = None,
    train: TrainConfig | None = None,
    zero_grad: bool = True,
    seq_dims: Sequence[int] | None = None,
    cp_buffers: Sequence[tuple[torch.Tensor, int]] = (),
) -> float:
    """Forward and backward over ``micro_batches``, then ``optimizer.step()``; returns the mean loss.

    Args:
        model: the model after ``plan.apply`` (an FSDP2 module), or any module
            (without FSDP2 the sync mode does not apply).
        micro_batches: one tuple of positional inputs per micro-batch; there
            must be as many as the plan's ``grad_accumulation``.
        loss_fn: ``loss_fn(output, inputs) -> scalar``, a mean over the micro-batch.
        plan, train: where the accumulation and sync mode come from (``train``
            wins; neither: every micro-batch synchronises).
        zero_grad: clear the gradients after the step (``set_to_none``).
        seq_dims, cp_buffers: under context parallelism, the sequence dim of each tensor of a
            micro-batch (default 1), and the model's own buffers to shard with them.
    """
    cfg = train if train is not None else plan.train_config if plan is not None else None
    batches = [b if isinstance(b, tuple) else (b,) for b in micro_batches]
    k = len(batches)
    if k < 1:
        raise ValueError("train_step needs at least one micro-batch")
    if cfg is not None and cfg.grad_accumulation != k:
        raise PlanError(f"the plan was scored for {cfg.grad_accumulation} micro-batches per step, got {k}; "
                        f"pass {cfg.grad_accumulation}, or re-run the search with --accumulation {k}")
    no_sync = cfg is not None and k > 1 and cfg.accumulation_sync == "last"
    can_toggle = hasattr(model, "set_requires_gradient_sync")
    total = 0.0
    try:
        for i, inputs in enumerate(batches):
            if no_sync and can_toggle:
                model.set_requires_gradient_sync(i == k - 1)  # type: ignore[operator]
            with _step_context(plan, model, inputs, seq_dims, cp_buffers):
                loss = scalar_loss(loss_fn(model(*inputs), inputs), loss_fn)
                (loss / k if k > 1 else loss).backward()
            total += _cp_mean(plan, model, loss.detach())
    finally:
        if no_sync and can_toggle:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
    optimizer.step()
    after_optimizer_step(model)  # the float8 all-gather's scales: See [Note: applying float8] in plan/float8.py
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    return total / k


def _cp_size(plan: WrapPlan | None) -> int:
    return getattr(plan.spec.mesh, "cp_size", 1) if plan is not None else 1


def _step_context(plan: WrapPlan | None, model: nn.Module, inputs: tuple[Any, ...], seq_dims: Sequence[int] | None,
                  cp_buffers: Sequence[tuple[torch.Tensor, int]]) -> Any:
    """``plan.train_context`` over the micro-batch's tensors and ``cp_buffers`` under context
    parallelism; else no context (train_step's loop as before)."""
    if _cp_size(plan) == 1:
        return contextlib.nullcontext()
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    dims = list(seq_dims) if seq_dims is not None else [1] * len(tensors)
    return plan.train_context(model, buffers=[*tensors, *(b for b, _ in cp_buffers)],  # type: ignore[union-attr]
                              seq_dims=[*dims, *(d for _, d in cp_buffers)])


def _cp_mean(plan: WrapPlan | None, model: nn.Module, loss: torch.Tensor) -> float:
    """The micro-batch's loss: under context parallelism the mean of the cp ranks' (each the
    mean over its own, equal share of the tokens)."""
    if _cp_size(plan) == 1:
        return float(loss)
    mesh = cp_mesh_of(model)
    loss = loss.clone()
    dist.all_reduce(loss, group=mesh.get_group())
    return float(loss) / mesh.size()
