"""Measure how fast this device computes: throughput, bandwidth, fixed costs, per-module times.

``measure_compute()`` runs on one process (no collective unless it measures the
FSDP unit overhead, see below). ``measure_unit_overhead()`` is collective.

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
times are kernel times plus one launch latency per module.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.errors import ModelError, ProfileError
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.losses import default_loss

__all__ = [
    "measure_compute",
    "measure_module_times",
    "measure_module_overhead",
    "measure_unit_overhead",
    "measure_checkpoint_overhead",
    "measure_optimizer",
    "measure_loss_time",
]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _sync_for(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _time_reps(fn: Callable[[], Any], *, repeats: int, warmup: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``fn`` over ``repeats`` timed calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return _median(ts)


def _matmul_flops_per_s(device: torch.device, repeats: int) -> float:
    """Dense square matmul throughput: fp32 512^2 on CPU, bf16 8192^2 on GPU (the dtypes models train in)."""
    n, dt = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    c = torch.empty_like(a)
    sync = _sync_for(device)
    one = _time_reps(lambda: torch.mm(a, b, out=c), repeats=3, warmup=1, sync=sync)
    # ~40 ms per repeat: long enough to hide timer and launch noise, ~0.2 s in all on a CPU.
    iters = max(1, min(10_000, round(0.04 / max(one, 1e-9))))

    def loop() -> None:
        for _ in range(iters):
            torch.mm(a, b, out=c)

    return 2 * n**3 * iters / _time_reps(loop, repeats=repeats, warmup=0, sync=sync)


def _copy_bytes_per_s(device: torch.device, repeats: int) -> float:
    """Memory bandwidth from a large copy, counting the bytes read plus the bytes written."""
    nbytes = 2**30 if device.type == "cuda" else 64 * 2**20  # well past any cache
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = _time_reps(lambda: dst.copy_(src), repeats=repeats, warmup=1, sync=_sync_for(device))
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

    return _time_reps(loop, repeats=repeats, warmup=1, sync=_sync_for(device)) / calls


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
    sync = _sync_for(device)
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
            loss = loss_fn(out, inputs)
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
    fwd_med = {fqn: _median([s.get(fqn, 0.0) for s in per_step]) for fqn in names.values()}
    total = sum(fwd_med.values()) or 1.0
    t_bwd = _median(bwd_total)
    return tuple((fqn, max(f, 0.0), max(f, 0.0) / total * t_bwd) for fqn, f in fwd_med.items())


def measure_unit_overhead(*, num_layers: int = 16, repeats: int = 5, warmup: int = 2) -> float:
    """Fixed seconds FSDP2 adds per unit per all-gather, collectives excluded; collective: every rank calls it.

    Times a forward+backward step of ``num_layers`` tiny ``nn.Linear(8, 8)``
    layers with ``fully_shard`` on every layer and the root ("many": the
    root owns no parameters, so N units with 2 all-gathers and 1
    reduce-scatter each) and on the root only ("one": one unit, one
    all-gather, one reduce-scatter, as the root is not resharded after
    forward). The same modules run in both, so the difference is FSDP's own
    work per unit (hooks, copy-in/copy-out, stream and state bookkeeping)
    plus the extra collectives, whose latency is measured directly and
    taken out::
        per_unit_step = (t_many - t_one - (2N - 1) * t_all_gather - (N - 1) * t_reduce_scatter) / (N - 1)

    ``per_unit_step`` is what one resharding unit adds to a training step
    (its pre/post-forward and pre/post-backward work, the reduce-scatter's
    bookkeeping included). The result is ``per_unit_step / 2``, floored at
    0 and the max over ranks: the ``unit_overhead_s`` the cost model adds
    once per all-gather, so twice per step for a unit resharded after
    forward, which reproduces the measured step.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise ProfileError("measure_unit_overhead needs a process group; call it on every rank under torchrun or spawn")
    if num_layers < 2:
        raise ValueError(f"num_layers must be at least 2, got {num_layers}")
    world = dist.get_world_size()
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev_type, torch.cuda.current_device()) if dev_type == "cuda" else torch.device("cpu")
    sync = _sync_for(device)
    mesh = init_device_mesh(dev_type, (world,))
    x = torch.randn(4, 8, device=device)

    def build(per_layer: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(8, 8, device=device) for _ in range(num_layers)))
        if per_layer:
            for layer in model:
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def step_of(model: nn.Module) -> Callable[[], None]:
        # No barrier between steps: the first all-gather of each step lines the ranks up.
        return lambda: model(x).sum().backward()

    # The tiny collectives FSDP issues per unit: one layer's parameters (72 fp32) unsharded.
    numel = 72 // world * world or world
    full, shard = torch.zeros(numel, device=device), torch.zeros(numel // world, device=device)
    t_ag = _time_reps(lambda: _all_gather(full, shard), repeats=repeats * 4, warmup=warmup, sync=sync)
    t_rs = _time_reps(lambda: _reduce_scatter(shard, full), repeats=repeats * 4, warmup=warmup, sync=sync)
    t_many = _time_reps(step_of(build(True)), repeats=repeats, warmup=warmup, sync=sync)
    t_one = _time_reps(step_of(build(False)), repeats=repeats, warmup=warmup, sync=sync)
    n = num_layers
    per_unit_step = (t_many - t_one - (2 * n - 1) * t_ag - (n - 1) * t_rs) / (n - 1)
    # Ranks must agree: the slowest rank's overhead is what every rank waits for.
    out = torch.tensor([max(per_unit_step / 2, 0.0)], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out[0])


def measure_optimizer(*, num_tensors: int = 32, repeats: int = 5) -> tuple[float, float, float]:
    """AdamW steps on FSDP2-sharded (DTensor) parameters; collective.

    Returns ``(per_tensor_s, per_tensor_2d_s, bandwidth_bytes_per_s)``: seconds
    per parameter tensor (``num_tensors`` tiny tensors, dispatch-bound) on a 1-D
    mesh and on a 2-D (world, 1) mesh as HSDP and no-shard plans use (0.0 on
    one rank), and the step's effective bandwidth from four large tensors,
    counted as the simulator counts it: (2 + 2 * 2 states) bytes per parameter
    byte of the local shard. Medians, max over ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise ProfileError("measure_optimizer needs a process group")
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev_type, torch.cuda.current_device()) if dev_type == "cuda" else torch.device("cpu")
    world = dist.get_world_size()
    sync = _sync_for(device)

    def stepper(model: nn.Module, mesh: Any) -> Callable[[], Any]:
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        return opt.step

    def step_time(model: nn.Module, mesh: Any) -> float:
        return _time_reps(stepper(model, mesh), repeats=repeats, warmup=2, sync=sync)

    def tiny() -> nn.Module:
        return nn.Sequential(*(nn.Linear(8, 8, device=device) for _ in range(num_tensors // 2)))

    mesh1 = init_device_mesh(dev_type, (world,))
    per_tensor_2d = 0.0
    if world > 1:  # the 2-D extra decides no-shard against one unit: timed interleaved with the 1-D
        # step and taken as the median paired ratio (sequential medians moved it 2x between runs here)
        mesh2 = init_device_mesh(dev_type, (world, 1), mesh_dim_names=("replicate", "shard"))
        one, two = stepper(tiny(), mesh1), stepper(tiny(), mesh2)
        pairs = [(_time_reps(one, repeats=1, warmup=0, sync=sync), _time_reps(two, repeats=1, warmup=0, sync=sync))
                 for _ in range(2 + max(repeats, 9))][2:]
        per_tensor = _median([a for a, _b in pairs]) / num_tensors
        per_tensor_2d = per_tensor * _median([b / a for a, b in pairs])
    else:
        per_tensor = step_time(tiny(), mesh1) / num_tensors
    n = 4096 if dev_type == "cuda" else 1024
    big = nn.Sequential(*(nn.Linear(n, n, bias=False, device=device) for _ in range(4)))
    local_bytes = 4 * n * n * 4 / world
    t_big = step_time(big, mesh1) - 4 * per_tensor
    counted = 2 + 2 * 2  # bytes per parameter byte as cost/simulate.py counts AdamW (two states)
    bandwidth = local_bytes * counted / t_big if t_big > 0 else 0.0
    out = torch.tensor([per_tensor, per_tensor_2d, -bandwidth], dtype=torch.float64,
                       device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(out, op=dist.ReduceOp.MAX)  # slowest rank: max time, min bandwidth
    return float(out[0]), float(out[1]), -float(out[2])


def measure_loss_time(model: nn.Module, example_inputs: tuple[Any, ...], loss_fn: Callable[..., torch.Tensor],
                      *, repeats: int = 5) -> float:
    """Seconds of the loss's forward and backward on the model's real output (outside every module)."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    with torch.no_grad():
        out = model(*inputs)
    dev = out.device if isinstance(out, torch.Tensor) else torch.device("cpu")

    def run() -> None:
        o = out.detach().requires_grad_(True) if isinstance(out, torch.Tensor) else out
        loss = loss_fn(o, inputs)
        if loss.requires_grad:
            loss.backward()

    return _time_reps(run, repeats=repeats, warmup=1, sync=_sync_for(dev))


def _first_block(model: nn.Module) -> nn.Module | None:
    """The first module of the first run of 2+ same-class siblings in a ModuleList or Sequential."""
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2 and type(m[0]) is type(m[1]):
            return m[0]
    return None


def measure_checkpoint_overhead(model: nn.Module, example_inputs: tuple[Any, ...] | Any, *,
                                repeats: int = 5) -> float:
    """Seconds activation checkpointing adds to one block beyond re-running its forward.

    Takes the model's first repeated block (None: 0.0), captures its inputs in
    one forward, and times forward+backward of a copy of the block plain
    (``t_plain``), checkpointed with the composable ``checkpoint`` as
    ``apply_plan`` does (``t_ckpt``), and its forward alone (``t_fwd``)::
        overhead = max(0, t_ckpt - t_plain - t_fwd)

    On CPU this is milliseconds per block (saved-tensor hooks and the
    recompute's bookkeeping), larger than a tiny block's forward.
    """
    import copy

    from torch.distributed._composable import checkpoint

    block = _first_block(model)
    if block is None:
        return 0.0
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
        return 0.0
    args, kwargs = captured["call"]
    # A Hugging Face cache (past_key_value(s)) would grow with every timed call: the block runs without one.
    kwargs = {k: (None if "past_key_value" in k else False if k == "use_cache" else v) for k, v in kwargs.items()}
    device = next(block.parameters(), torch.empty(0)).device
    sync = _sync_for(device)

    def fresh() -> tuple[Any, ...]:
        return tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args)

    plain, ckpt = copy.deepcopy(block), copy.deepcopy(block)
    checkpoint(ckpt)

    def step(b: nn.Module, backward: bool = True) -> Callable[[], None]:
        def run() -> None:
            out = b(*fresh(), **kwargs)
            if backward:
                sum(t.float().sum() for t in _float_outputs(out)).backward()
        return run

    runs = (step(plain), step(ckpt), step(plain, False))
    times: list[list[float]] = [[], [], []]
    for r in range(3 + max(repeats * 4, 10)):  # interleaved, so that load changes hit all three alike
        for i, fn in enumerate(runs):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= 3:
                times[i].append(time.perf_counter() - t0)
    t_plain, t_ckpt, t_fwd = (_median(t) for t in times)
    return max(0.0, t_ckpt - t_plain - t_fwd)


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
    if device is None:
        params = list(model.parameters()) if model is not None else []
        device = params[0].device if params else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    meta: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "matmul": "bf16 8192^2" if device.type == "cuda" else "fp32 512^2",
    }
    module_times: tuple[tuple[str, float, float], ...] = ()
    if model is not None:
        module_times = measure_module_times(model, example_inputs, loss_fn=loss_fn, repeats=repeats)
        meta["module_times"] = "measured self times; backward attributed by forward share"
    loss_s = 0.0
    if model is not None and loss_fn is not None:
        loss_s = measure_loss_time(model, example_inputs, loss_fn, repeats=repeats)
    checkpoint_overhead_s = 0.0
    if model is not None:
        checkpoint_overhead_s = measure_checkpoint_overhead(model, example_inputs, repeats=repeats)
        meta["checkpoint_overhead"] = "first repeated block: checkpointed - plain - forward"
    optimizer_tensor_s = optimizer_tensor_2d_s = optimizer_bandwidth = 0.0
    if dist.is_initialized():
        optimizer_tensor_s, optimizer_tensor_2d_s, optimizer_bandwidth = measure_optimizer(repeats=repeats)
        meta["optimizer"] = "AdamW steps on fully_shard parameters: per tensor (1-D and 2-D mesh), bandwidth"
    if unit_overhead_s is None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            unit_overhead_s = measure_unit_overhead(repeats=repeats)
            meta["unit_overhead"] = f"measured with fully_shard on {dist.get_world_size()} ranks"
        else:
            unit_overhead_s = 0.0
            meta["unit_overhead"] = "not measured (no process group); call measure_unit_overhead() under one"
    return ComputeProfile(
        kind="measured",
        device=str(device),
        flops_per_s=_matmul_flops_per_s(device, repeats),
        memory_bandwidth_bytes_per_s=_copy_bytes_per_s(device, repeats),
        memory_capacity_bytes=_memory_capacity_bytes(device),
        unit_overhead_s=unit_overhead_s,
        module_overhead_s=measure_module_overhead(device=device, repeats=repeats),
        optimizer_tensor_s=optimizer_tensor_s,
        optimizer_tensor_2d_s=optimizer_tensor_2d_s,
        optimizer_bandwidth_bytes_per_s=optimizer_bandwidth,
        loss_s=loss_s,
        checkpoint_overhead_s=checkpoint_overhead_s,
        module_times=module_times,
        runs_ahead=torch.device(device).type != "cpu",  # a CUDA stream queues work; a CPU runs it as issued
        meta=meta,
    )
