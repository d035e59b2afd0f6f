"""Measure what a training step adds around a model's modules: the loss, activation checkpointing,
selective-op checkpointing, and the share of the step its batch size does not scale.

Each is timed on the model itself (or its first repeated block) on this process alone; no
collective. ``measure_device.measure_compute`` calls them when given a model, and re-exports them,
inside ``stepped_briefly``.

[Note: time a stepped model] A freshly built model is not what training times. A head tied to a
default ``nn.Embedding`` (N(0, 1) weights) gives logits ~100 apart at init (a cross-entropy of ~80),
so a third of the softmax's gradient lies in the denormal range (below 1.2e-38 in fp32) and a CPU's
matmuls on it run ~50x slower: the ``mha-tied`` bench model at d=128 (vocabulary 2048, batch 4 x 64,
one thread) took 0.31 s for its head's backward matmuls fresh and 0.006 s after 3 AdamW steps, and
0.37 s against 0.085 s for the whole backward. Training leaves this state in its first steps, so a
profile taken on the fresh model charges every step of the job for it. The model's figures are
therefore timed after AdamW steps (lr 1e-3, the common default) on the example inputs and the
profile's loss, taken until, in a forward and backward, no parameter, module output or output gradient
is 0.1% denormal (at most ``SETTLE_STEPS``; a model with none is not stepped). How many depends on
the model: the d=128 family took 3 steps with 8 blocks, 6 with 4, 10 with 2 and 18 with 1 (its loss
falls ~3 a step; the denormals go as the logits shrink), so a fixed count would not do; of the zoo,
t5-tiny and tx-tied take 2 and the others none. The parameters, buffers and the RNG states are
restored afterwards, so the caller's model comes back as it was. Stepping, not
``torch.set_flush_denormal(True)``: flushing is not a training default (a model whose steady state
keeps denormals is slow in training too, and is timed so after the cap), and it changes the
arithmetic of every op, not only of the first steps.
A model without trainable parameters, or on the meta device, is timed as given.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from wrapopt.hardware.timing import median, sync_for, time_reps
from wrapopt.losses import default_loss, scalar_loss

__all__ = ["measure_loss_time", "measure_checkpoint_overhead", "measure_selective_overhead",
           "measure_batch_fixed_share", "stepped_briefly"]

SETTLE_STEPS = 24  # the most AdamW steps before the model's figures are timed: See [Note: time a stepped model]
SETTLE_LR = 1e-3
_DENORMAL_SHARE = 1e-3  # a step whose every activation, gradient and parameter holds fewer ends the stepping
_TINY = {dt: torch.finfo(dt).tiny for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


class _DenormalCount:
    """The largest share of denormal values in any of the model's parameters, its modules' float outputs and
    those outputs' gradients over one forward and backward (the operands of the step's matmuls)."""

    def __init__(self, model: nn.Module) -> None:
        self.worst = 0.0
        self.model = model
        self.handles = [m.register_forward_hook(self._output) for m in model.modules()]

    def add(self, t: torch.Tensor) -> None:
        if t.dtype in _TINY and t.numel() and not t.is_meta:
            a = t.detach().abs()
            self.worst = max(self.worst, ((a > 0) & (a < _TINY[t.dtype])).float().mean().item())

    def _output(self, _m: nn.Module, _args: Any, out: Any) -> None:
        for t in _tensors(out):
            self.add(t)
            if t.requires_grad:
                t.register_hook(self.add)

    def share(self) -> float:
        for p in self.model.parameters():
            self.add(p)
        for h in self.handles:
            h.remove()
        return self.worst


@contextlib.contextmanager
def stepped_briefly(model: nn.Module, example_inputs: tuple[Any, ...] | Any,
                    loss_fn: Callable[..., torch.Tensor] | None = None, *,
                    max_steps: int = SETTLE_STEPS) -> Iterator[int]:
    """Steps ``model`` in place with AdamW until a forward and backward meet few denormal values (at most
    ``max_steps`` steps), yields the number of steps taken, then restores its parameters, buffers and the
    RNG states: See [Note: time a stepped model]. Yields 0 without a trainable parameter, on meta weights,
    with ``max_steps`` 0 or when the given model has no denormals to leave. The restore copies into the
    same tensors, so references to the model's parameters stay valid. Costs a host copy of the model's
    state and, while stepping, AdamW's two states of the trainable parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if max_steps <= 0 or not trainable or any(p.is_meta for p in model.parameters()):
        yield 0
        return
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    loss_fn = loss_fn or default_loss
    device = trainable[0].device
    saved = [(t, t.detach().to("cpu", copy=True)) for t in itertools.chain(model.parameters(), model.buffers())]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            opt = torch.optim.AdamW(trainable, lr=SETTLE_LR)
            steps = 0
            while True:
                opt.zero_grad(set_to_none=True)
                count = _DenormalCount(model)
                try:
                    scalar_loss(loss_fn(model(*inputs), inputs), loss_fn).backward()
                finally:
                    share = count.share()
                if share < _DENORMAL_SHARE or steps == max_steps:
                    break
                opt.step()
                steps += 1
            del opt  # its states (2x the trainable parameters) go before the timing
            model.zero_grad(set_to_none=True)
            yield steps
        finally:
            model.zero_grad(set_to_none=True)
            with torch.no_grad():
                for t, s in saved:
                    t.copy_(s)


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


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def _float_outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _float_outputs(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _float_outputs(o)]
    return []
