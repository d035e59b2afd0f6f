"""Measure how fast this device computes: throughput, bandwidth, fixed costs, per-module times.

``measure_compute()`` runs on one process (no collective unless it measures the
FSDP unit overhead, see below) and assembles the ``ComputeProfile``.
``measure_unit_overhead()`` and ``measure_optimizer()`` (``measure_fsdp.py``) are
collective; the loss, checkpointing and batch-share figures are timed in
``measure_overheads.py``. Both are re-exported here.

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
misses the pauses that fall in some call of every step (ranks sharing a core
are descheduled now and then, each step in a different module); the backward,
timed whole, keeps them already.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.consensus import every_rank
from wrapopt.errors import ModelError
from wrapopt.hardware.measure_fsdp import (
    measure_byte_overhead, measure_optimizer, measure_param_overhead, measure_pipeline_action, measure_unit_overhead,
)
from wrapopt.hardware.measure_overheads import (
    SETTLE_LR, SETTLE_STEPS, measure_batch_fixed_share, measure_checkpoint_overhead, measure_loss_time,
    measure_selective_overhead, stepped_briefly,
)
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.hardware.timing import median, sync_for, time_reps
from wrapopt.losses import default_loss, scalar_loss

__all__ = ["measure_compute", "measure_module_times", "measure_module_overhead", "measure_unit_overhead",
           "measure_checkpoint_overhead", "measure_selective_overhead", "measure_optimizer", "measure_loss_time",
           "measure_batch_fixed_share", "stepped_briefly"]

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
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[tuple[str, float, float], ...]:
    """Measured ``(fqn, fwd_s, bwd_s)`` self times for every module of ``model``, root as ``""``.

    See [Note: measured module times]. Medians over ``repeats`` steps after
    ``warmup``; a module never called gets zeros. The model runs real
    forward and backward steps on the device its parameters are on, and its
    gradients are cleared afterwards. ``clock`` (seconds) is read at every
    hook and around the backward; tests pass a synthetic one.
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
        stack.append([clock(), 0.0])

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        sync()
        start, children = stack.pop()
        inclusive = clock() - start
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
            t0 = clock()
            loss.backward()
            sync()
            if step >= warmup:
                bwd_total.append(clock() - t0)
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
            (see [Note: measured module times]), timed after a few AdamW steps that are undone
            afterwards (see [Note: time a stepped model] in measure_overheads.py).
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
    meta = _device_meta(device)
    # The model's own runs are local: a rank whose forward fails tells the others before they wait for it in
    # the collectives below (See [Note: every rank explains] in wrapopt/consensus.py).
    # Timed after a few optimizer steps, the model restored after: See [Note: time a stepped model] in
    # measure_overheads.py.
    with every_rank("running the model to time its modules"), _stepped(model, example_inputs, loss_fn, meta):
        module_times, loss_s, ckpt_s, selective_s = _model_figures(model, example_inputs, loss_fn, repeats, meta)
        fixed_share = 0.0
        if model is not None:  # See [Note: batch scaling] in cost/calls.py
            fixed_share = measure_batch_fixed_share(model, example_inputs, loss_fn, repeats=repeats)
            meta["batch_fixed_share"] = "whole model at its batch and at half of it, interleaved"
    group = _group_figures(repeats, unit_overhead_s, meta)
    return ComputeProfile(
        kind="measured",
        device=str(device),
        flops_per_s=_matmul_flops_per_s(device, repeats),
        memory_bandwidth_bytes_per_s=_copy_bytes_per_s(device, repeats),
        memory_capacity_bytes=_memory_capacity_bytes(device),
        **group,
        module_overhead_s=measure_module_overhead(device=device, repeats=repeats),
        loss_s=loss_s,
        checkpoint_overhead_s=ckpt_s[0],
        checkpoint_forward_s=ckpt_s[1],
        selective_op_overhead_s=selective_s,
        module_times=module_times,
        batch_fixed_share=fixed_share,
        runs_ahead=torch.device(device).type != "cpu",  # a CUDA stream queues work; a CPU runs it as issued
        meta=meta,
    )


def _device_meta(device: torch.device) -> dict[str, Any]:
    """What the profile's ``meta`` says of the device and how its matmul rate was timed."""
    return {
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "matmul": "bf16 8192^2" if device.type == "cuda" else "fp32 512^2",
    }


def _group_figures(repeats: int, unit_overhead_s: float | None, meta: dict[str, Any]) -> dict[str, float]:
    """The ``ComputeProfile`` fields only a process group measures (collective: every rank calls it), in the
    order ``measure_compute`` always took them: the optimizer step on sharded parameters, FSDP2's overheads
    (``unit_overhead_s`` when already known) and the pipeline schedule's host work per action; 0 without one."""
    out = dict.fromkeys(("optimizer_tensor_s", "optimizer_tensor_2d_s", "optimizer_bandwidth_bytes_per_s",
                         "param_overhead_s", "byte_overhead_s", "pipeline_action_s"), 0.0)
    if dist.is_initialized():
        (out["optimizer_tensor_s"], out["optimizer_tensor_2d_s"],
         out["optimizer_bandwidth_bytes_per_s"]) = measure_optimizer(repeats=repeats)
        meta["optimizer"] = "AdamW steps on fully_shard parameters: per tensor (1-D and 2-D mesh), bandwidth"
    if unit_overhead_s is None:
        unit_overhead_s, out["param_overhead_s"], out["byte_overhead_s"] = _unit_overhead(repeats, meta)
    out["unit_overhead_s"] = unit_overhead_s
    if dist.is_initialized() and dist.get_world_size() > 1:  # See [Note: pipeline actions] in cost/pipeline.py
        out["pipeline_action_s"] = measure_pipeline_action(repeats=repeats)
        meta["pipeline_action"] = ("Schedule1F1B of 2 and 8 micro-batches on rank pairs, less their sends"
                                   if 2 <= dist.get_world_size() <= 8 and dist.get_world_size() % 2 == 0
                                   else "not measured: an even group of 2 to 8 ranks measures it")
    return out



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


@contextlib.contextmanager
def _stepped(model: nn.Module | None, example_inputs: Any, loss_fn: Callable[..., torch.Tensor] | None,
             meta: dict[str, Any]) -> Iterator[None]:
    """The model, if any, stepped briefly for its figures (``meta["model_state"]`` says whether)."""
    if model is None:
        yield
        return
    with stepped_briefly(model, example_inputs, loss_fn) as steps:
        meta["model_state"] = (f"timed after {steps} AdamW steps (lr {SETTLE_LR:g}, at most {SETTLE_STEPS}: "
                               "until no tensor of a step was 0.1% denormal), weights restored after"
                               if steps else "timed as given (no denormals to step away, or nothing to step)")
        yield


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
