"""Measure how fast this device computes: throughput, bandwidth, fixed costs, per-module times.

``measure_compute()`` runs on one process (no collective unless it measures the
FSDP unit overhead, see below). ``measure_unit_overhead()`` and ``measure_optimizer()``
(``measure_fsdp.py``, re-exported here) are collective.

[Note: measured module times] Forward pre/post hooks on every module give each
call's *inclusive* time; a module's *self* time is that minus the inclusive
time of the child calls made inside it, so the self times of all modules add
up to the root's inclusive time (the root's own ops, e.g. the position
embedding add, go to fqn ``""``). Backward hooks are unreliable per module
(some never fire, see ModTracker), so the backward step is timed whole and
attributed by each module's share of the forward self time:
``bwd_s(m) = fwd_s(m) / sum(fwd_s) * t_backward`` (``t_backward`` is the
whole ``loss.backward()``, the loss's own tiny backward included; the loss's
forward is outside the model and not counted). That is exact when every
module's backward costs the same multiple of its forward (about 2x for
matmuls) and approximate otherwise. On a GPU each hook synchronises, so the
times are kernel times plus one launch latency per module. The medians of the
self times give the shares; their sum is scaled to the median of the whole
forward (the root's inclusive time), because a sum of medians of short calls
misses the pauses that fall in some call of every step: ranks sharing a core
(4 gloo ranks on 2 cores) read llama-tiny's forward as 6.3 ms summed, where
each step's forward takes 15 ms (its backward, timed whole, reads right).
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from wrapopt.consensus import every_rank
from wrapopt.errors import ModelError
from wrapopt.hardware.measure_fsdp import (
    measure_byte_overhead, measure_optimizer, measure_param_overhead, measure_pipeline_action, measure_unit_overhead,
)
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.hardware.timing import median, sync_for, time_reps
from wrapopt.losses import default_loss, scalar_loss

__all__ = ["measure_compute", "measure_module_times", "measure_module_overhead", "measure_unit_overhead",
           "measure_checkpoint_overhead", "measure_selective_overhead", "measure_optimizer", "measure_loss_time",
           "measure_batch_fixed_share"]

def _matmul_flops_per_s(device: torch.device, repeats: int) -> float:
    """Dense square matmul throughput: fp32 512^2 on CPU, bf16 8192^2 on GPU (the dtypes models train in)."""
    n, dt = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    c = torch.empty_like(a)
    sync = sync_for(device)
    one = time_reps(lambda: torch.mm(a, b, out=c), repeats=3, warmup=1, sync=sync)
    # ~40 ms per repeat: long enough to hide timer and launch noise, ~0.2 s in all on a CPU.
    iters = max(1, min(10_000, round(0.04 / max(one, 1e-9))))

    def loop() -> None:
        for _ in range(iters):
            torch.mm(a, b, out=c)

    return 2 * n**3 * iters / time_reps(loop, repeats=repeats, warmup=0, sync=sync)


def _copy_bytes_per_s(device: torch.device, repeats: int) -> float:
    """Memory bandwidth from a large copy, counting the bytes read plus the bytes written."""
    nbytes = 2**30 if device.type == "cuda" else 64 * 2**20  # well past any cache
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = time_reps(lambda: dst.copy_(src), repeats=repeats, warmup=1, sync=sync_for(device))
    return 2 * nbytes / t


def _memory_capacity_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system with these names
        return None


def measure_module_overhead(*, device: torch.device | str | None = None, repeats: int = 5, calls: int = 200) -> float:
    """Fixed seconds per module call: forward + backward of ``nn.Linear(1, 1)`` on a 1x1 input.

    The arithmetic is nil, so this is op dispatch, autograd bookkeeping and
    (on a GPU) kernel launches: the floor under any module's time.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lin = nn.Linear(1, 1, device=device)
    x = torch.ones(1, 1, device=device)

    def loop() -> None:
        for _ in range(calls):
            lin(x).sum().backward()

    return time_reps(loop, repeats=repeats, warmup=1, sync=sync_for(device)) / calls


def measure_module_times(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    repeats: int = 5,
    warmup: int = 1,
) -> tuple[tuple[str, float, float], ...]:
    """Measured ``(fqn, fwd_s, bwd_s)`` self times for every module of ``model``, root as ``""``.

    See [Note: measured module times]. Medians over ``repeats`` steps after
    ``warmup``; a module never called gets zeros. The model runs real
    forward and backward steps on the device its parameters are on, and its
    gradients are cleared afterwards.
    """

    loss_fn = loss_fn or default_loss
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    params = list(model.parameters())
    if any(p.is_meta for p in params):
        raise ModelError("measuring module times needs real weights; build the model on a real device, not meta")
    device = params[0].device if params else torch.device("cpu")
    sync = sync_for(device)
    names = {id(m): fqn for fqn, m in model.named_modules()}
    fwd: dict[str, float] = {}
    stack: list[list[float]] = []  # per open call: [start, inclusive time of its children so far]

    def pre(mod: nn.Module, args: Any) -> None:
        sync()
        stack.append([time.perf_counter(), 0.0])

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        sync()
        start, children = stack.pop()
        inclusive = time.perf_counter() - start
        fqn = names[id(mod)]
        fwd[fqn] = fwd.get(fqn, 0.0) + inclusive - children  # a module called twice adds up
        if stack:
            stack[-1][1] += inclusive

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    per_step: list[dict[str, float]] = []
    bwd_total: list[float] = []
    try:
        for step in range(warmup + repeats):
            model.zero_grad(set_to_none=True)  # every step allocates its gradients alike
            fwd.clear()
            stack.clear()
            out = model(*inputs)
            loss = scalar_loss(loss_fn(out, inputs), loss_fn)
            sync()
            t0 = time.perf_counter()
            loss.backward()
            sync()
            if step >= warmup:
                bwd_total.append(time.perf_counter() - t0)
                per_step.append(dict(fwd))
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    fwd_med = {fqn: median([s.get(fqn, 0.0) for s in per_step]) for fqn in names.values()}
    total = sum(fwd_med.values()) or 1.0
    # the medians' shares of the whole forward (a step's self times add up to the root's inclusive time): See the Note
    t_fwd, t_bwd = median([sum(s.values()) for s in per_step]) or total, median(bwd_total)
    return tuple((fqn, max(f, 0.0) / total * t_fwd, max(f, 0.0) / total * t_bwd) for fqn, f in fwd_med.items())


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
    import copy

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
    import copy

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


def measure_compute(
    *,
    device: torch.device | str | None = None,
    model: nn.Module | None = None,
    example_inputs: tuple[Any, ...] | Any = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    repeats: int = 5,
    unit_overhead_s: float | None = None,
) -> ComputeProfile:
    """Measure this device: matmul throughput, copy bandwidth, capacity, fixed costs, module times.

    Args:
        device: default: the model's device, else CUDA if available, else CPU.
        model: optional, with real weights; adds measured per-module times
            (see [Note: measured module times]).
        example_inputs: the model's inputs (needed with ``model``).
        loss_fn: ``loss_fn(output, inputs) -> scalar``; default: mean square of the outputs.
        repeats: timed repeats per figure (medians are kept).
        unit_overhead_s: the FSDP per-unit overhead if already known. ``None``
            measures it with ``measure_unit_overhead()`` when a process group
            of 2+ ranks is initialised; this is collective, so every rank
            must then call ``measure_compute``. Without a group it stays 0.

    Returns:
        A ``ComputeProfile`` of kind ``"measured"``.

    Example:
        >>> prof = measure_compute(device="cpu", repeats=3)
        >>> prof.kind, prof.flops_per_s > 0
        ('measured', True)
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if model is not None and example_inputs is None:
        raise ModelError("measure_compute(model=...) needs example_inputs= to run the model")
    device = _resolve_device(device, model)
    meta: dict[str, Any] = {
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "matmul": "bf16 8192^2" if device.type == "cuda" else "fp32 512^2",
    }
    # The model's own runs are local: a rank whose forward fails tells the others before they wait for it in
    # the collectives below (See [Note: every rank explains] in wrapopt/consensus.py).
    with every_rank("running the model to time its modules"):
        module_times, loss_s, ckpt_s, selective_s = _model_figures(model, example_inputs, loss_fn, repeats, meta)
        fixed_share = 0.0
        if model is not None:  # See [Note: batch scaling] in cost/calls.py
            fixed_share = measure_batch_fixed_share(model, example_inputs, loss_fn, repeats=repeats)
            meta["batch_fixed_share"] = "whole model at its batch and at half of it, interleaved"
    optimizer_tensor_s = optimizer_tensor_2d_s = optimizer_bandwidth = 0.0
    if dist.is_initialized():
        optimizer_tensor_s, optimizer_tensor_2d_s, optimizer_bandwidth = measure_optimizer(repeats=repeats)
        meta["optimizer"] = "AdamW steps on fully_shard parameters: per tensor (1-D and 2-D mesh), bandwidth"
    param_overhead_s = byte_overhead_s = 0.0
    if unit_overhead_s is None:
        unit_overhead_s, param_overhead_s, byte_overhead_s = _unit_overhead(repeats, meta)
    action_s = 0.0
    if dist.is_initialized() and dist.get_world_size() > 1:  # See [Note: pipeline actions] in cost/pipeline.py
        action_s = measure_pipeline_action(repeats=repeats)
        meta["pipeline_action"] = ("Schedule1F1B of 2 and 8 micro-batches on rank pairs, less their sends"
                                   if 2 <= dist.get_world_size() <= 8 and dist.get_world_size() % 2 == 0
                                   else "not measured: an even group of 2 to 8 ranks measures it")
    return ComputeProfile(
        kind="measured",
        device=str(device),
        flops_per_s=_matmul_flops_per_s(device, repeats),
        memory_bandwidth_bytes_per_s=_copy_bytes_per_s(device, repeats),
        memory_capacity_bytes=_memory_capacity_bytes(device),
        unit_overhead_s=unit_overhead_s,
        param_overhead_s=param_overhead_s,
        byte_overhead_s=byte_overhead_s,
        module_overhead_s=measure_module_overhead(device=device, repeats=repeats),
        optimizer_tensor_s=optimizer_tensor_s,
        optimizer_tensor_2d_s=optimizer_tensor_2d_s,
        optimizer_bandwidth_bytes_per_s=optimizer_bandwidth,
        loss_s=loss_s,
        checkpoint_overhead_s=ckpt_s[0],
        checkpoint_forward_s=ckpt_s[1],
        selective_op_overhead_s=selective_s,
        module_times=module_times,
        batch_fixed_share=fixed_share,
        pipeline_action_s=action_s,
        runs_ahead=torch.device(device).type != "cpu",  # a CUDA stream queues work; a CPU runs it as issued
        meta=meta,
    )



def _resolve_device(device: torch.device | str | None, model: nn.Module | None) -> torch.device:
    """The device to measure: as given, else the model's, else CUDA if available, else CPU
    (a CUDA device with its index)."""
    if device is None:
        params = list(model.parameters()) if model is not None else []
        device = params[0].device if params else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _model_figures(model: nn.Module | None, example_inputs: Any, loss_fn: Callable[..., torch.Tensor] | None,
                   repeats: int, meta: dict[str, Any]) -> tuple[tuple[tuple[str, float, float], ...], float,
                                                                 tuple[float, float], float]:
    """What the model itself adds, when given: its module times, its loss's time (with a ``loss_fn``), the
    overhead of checkpointing its first repeated block (and its forward's part) and selective-op's per-op cost."""
    module_times: tuple[tuple[str, float, float], ...] = ()
    if model is not None:
        module_times = measure_module_times(model, example_inputs, loss_fn=loss_fn, repeats=repeats)
        meta["module_times"] = "measured self times; backward attributed by forward share"
    loss_s = 0.0
    if model is not None and loss_fn is not None:
        loss_s = measure_loss_time(model, example_inputs, loss_fn, repeats=repeats)
    ckpt_s, selective_s = (0.0, 0.0), 0.0
    if model is not None:
        ckpt_s = measure_checkpoint_overhead(model, example_inputs, repeats=repeats)
        meta["checkpoint_overhead"] = "first repeated block: checkpointed - plain - forward (forward: its own)"
        selective_s = measure_selective_overhead(model, example_inputs, repeats=repeats)
        meta["selective_op_overhead"] = "first repeated block: (selective, recompute all - full) / (2 * forward ops)"
    return module_times, loss_s, ckpt_s, selective_s


def _unit_overhead(repeats: int, meta: dict[str, Any]) -> tuple[float, float, float]:
    """The FSDP overhead per unit, per parameter tensor and per gathered byte, measured under a process group
    of 2+ ranks, else 0: See [Note: per-parameter overhead] in measure_fsdp.py (the unit's, less its 2
    parameters) and [Note: per-byte overhead] there (a 4 MiB wider unit)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        per_param = measure_param_overhead(repeats=repeats)
        unit_overhead_s = max(measure_unit_overhead(repeats=repeats) - 2 * per_param, 0.0)
        meta["unit_overhead"] = f"measured with fully_shard on {dist.get_world_size()} ranks, less 2 parameters'"
        return unit_overhead_s, per_param, measure_byte_overhead(repeats=repeats)
    meta["unit_overhead"] = "not measured (no process group); call measure_unit_overhead() under one"
    return 0.0, 0.0, 0.0
