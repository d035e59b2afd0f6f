"""Measure what a training step adds around a model's modules: the loss, activation checkpointing,
selective-op checkpointing, and the share of the step its batch size does not scale.

Each is timed on the model itself (or its first repeated block) on this process alone; no
collective. ``measure_device.measure_compute`` calls them when given a model, and re-exports them.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from wrapopt.hardware.timing import median, sync_for, time_reps
from wrapopt.losses import default_loss, scalar_loss

__all__ = ["measure_loss_time", "measure_checkpoint_overhead", "measure_selective_overhead",
           "measure_batch_fixed_share"]


def measure_loss_time(model: nn.Module, example_inputs: tuple[Any, ...], loss_fn: Callable[..., torch.Tensor],
                      *, repeats: int = 5) -> float:
    """Seconds of the loss's forward and backward on the model's real output (outside every module)."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    with torch.no_grad():
        out = model(*inputs)
    dev = out.device if isinstance(out, torch.Tensor) else torch.device("cpu")

    def run() -> None:
        o = out.detach().requires_grad_(True) if isinstance(out, torch.Tensor) else out
        loss = scalar_loss(loss_fn(o, inputs), loss_fn)
        if loss.requires_grad:
            loss.backward()

    return time_reps(run, repeats=repeats, warmup=1, sync=sync_for(dev))


def _first_block(model: nn.Module) -> nn.Module | None:
    """The first module of the first run of 2+ same-class siblings in a ModuleList or Sequential."""
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2 and type(m[0]) is type(m[1]):
            return m[0]
    return None


def _block_call(model: nn.Module, example_inputs: tuple[Any, ...] | Any) -> tuple[Any, ...] | None:
    """The model's first repeated block, a function making fresh inputs for it (leaves that
    require grad), its keyword arguments and its device's sync, captured in one forward; None
    without a repeated block or when it never ran."""
    block = _first_block(model)
    if block is None:
        return None
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    captured: dict[str, Any] = {}

    def grab(_m: nn.Module, args: Any, kwargs: Any) -> None:
        captured.setdefault("call", (args, kwargs))

    h = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        h.remove()
    if "call" not in captured:
        return None
    args, kwargs = captured["call"]
    # A Hugging Face cache (past_key_value(s)) would grow with every timed call: the block runs without one.
    kwargs = {k: (None if "past_key_value" in k else False if k == "use_cache" else v) for k, v in kwargs.items()}
    device = next(block.parameters(), torch.empty(0)).device

    def fresh() -> tuple[Any, ...]:
        return tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                     for a in args)

    return block, fresh, kwargs, sync_for(device)


def _interleaved(runs: tuple[Callable[[], None], ...], repeats: int, sync: Callable[[], None]) -> list[float]:
    """Median seconds of each of ``runs``, timed in turn (so that load changes hit all alike)."""
    times: list[list[float]] = [[] for _ in runs]
    for r in range(3 + max(repeats * 4, 10)):
        for i, fn in enumerate(runs):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= 3:
                times[i].append(time.perf_counter() - t0)
    return [median(t) for t in times]


def _fwd_bwd(b: nn.Module, fresh: Callable[[], tuple[Any, ...]], kwargs: dict[str, Any],
             backward: bool = True) -> Callable[[], None]:
    def run() -> None:
        out = b(*fresh(), **kwargs)
        if backward:
            sum(t.float().sum() for t in _float_outputs(out)).backward()
    return run


def measure_checkpoint_overhead(model: nn.Module, example_inputs: tuple[Any, ...] | Any, *,
                                repeats: int = 5) -> tuple[float, float]:
    """Seconds activation checkpointing adds to one block beyond re-running its forward, and the
    part of them its first forward pays: See [Note: checkpoint overhead] in cost/step.py.

    Takes the model's first repeated block (None: zeros), captures its inputs in one forward, and
    times forward+backward of a copy of the block plain (``t_plain``), checkpointed with the
    composable ``checkpoint`` as ``apply_plan`` does (``t_ckpt``), and the forward alone of each
    (``t_fwd``, ``t_ckpt_fwd``)::
        overhead = max(0, t_ckpt - t_plain - t_fwd)
        forward part = min(overhead, max(0, t_ckpt_fwd - t_fwd))
    """
    from torch.distributed._composable import checkpoint

    found = _block_call(model, example_inputs)
    if found is None:
        return 0.0, 0.0
    block, fresh, kwargs, sync = found
    plain, ckpt = copy.deepcopy(block), copy.deepcopy(block)
    checkpoint(ckpt)
    t_plain, t_ckpt, t_fwd, t_ckpt_fwd = _interleaved(
        (_fwd_bwd(plain, fresh, kwargs), _fwd_bwd(ckpt, fresh, kwargs), _fwd_bwd(plain, fresh, kwargs, False),
         _fwd_bwd(ckpt, fresh, kwargs, False)), repeats, sync)
    total = max(0.0, t_ckpt - t_plain - t_fwd)
    return total, min(total, max(0.0, t_ckpt_fwd - t_fwd))


class _OpCount(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher's Python modes (as selective-op's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _recompute_all(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    return CheckpointPolicy.PREFER_RECOMPUTE


def measure_selective_overhead(model: nn.Module, example_inputs: tuple[Any, ...] | Any, *,
                               repeats: int = 5) -> float:
    """Seconds selective-op checkpointing adds per forward op and pass (its forward and its
    recompute each pay it): See [Note: selective checkpointing] in wrapopt/selective.py.

    Takes the model's first repeated block (None: 0.0) and times forward+backward of a copy
    checkpointed fully (``t_full``) and one checkpointed through torch's selective contexts
    with a policy that recomputes every op (``t_sel``: the same ops run, only the dispatch
    modes' work differs), and counts the ops of one forward (``n``)::
        overhead = max(0, t_sel - t_full) / (2 * n)
    """
    from torch.distributed._composable import checkpoint

    found = _block_call(model, example_inputs)
    if found is None:
        return 0.0
    block, fresh, kwargs, sync = found
    count = _OpCount()
    with count:
        block(*fresh(), **kwargs)
    full, sel = copy.deepcopy(block), copy.deepcopy(block)
    checkpoint(full)
    checkpoint(sel, context_fn=lambda: create_selective_checkpoint_contexts(_recompute_all))
    t_full, t_sel = _interleaved((_fwd_bwd(full, fresh, kwargs), _fwd_bwd(sel, fresh, kwargs)), repeats, sync)
    return max(0.0, t_sel - t_full) / (2 * count.ops) if count.ops else 0.0


def measure_batch_fixed_share(model: nn.Module, example_inputs: tuple[Any, ...] | Any,
                              loss_fn: Callable[..., torch.Tensor] | None = None, *, repeats: int = 5) -> float:
    """The share of the model's step that does not shrink with its batch: See [Note: batch scaling]
    in cost/calls.py. Forward, loss and backward at the inputs' batch (``t1``) and at half of it
    (``th``: every tensor input cut along dim 0), interleaved: ``(2 th - t1) / t1``, within [0, 0.9].
    0.0 when the inputs have no common batch of 2 or more."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    sizes = {x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1 or min(sizes) < 2:
        return 0.0
    half = tuple(x[: x.shape[0] // 2] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in inputs)
    loss_fn = loss_fn or default_loss
    params = list(model.parameters())
    sync = sync_for(params[0].device if params else torch.device("cpu"))

    def step(x: tuple[Any, ...]) -> Callable[[], None]:
        def run() -> None:
            scalar_loss(loss_fn(model(*x), x), loss_fn).backward()
        return run

    try:
        t1, th = _interleaved((step(inputs), step(half)), repeats, sync)
    finally:
        model.zero_grad(set_to_none=True)
    return min(0.9, max(0.0, (2 * th - t1) / t1)) if t1 > 0 else 0.0


def _float_outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _float_outputs(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _float_outputs(o)]
    return []
