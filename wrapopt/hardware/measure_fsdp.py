"""Measure what FSDP2 itself costs on this process group: the fixed overhead per unit, and the
optimizer step on sharded parameters. Both are collective: every rank calls them."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.errors import ProfileError
from wrapopt.hardware.collective_ops import all_gather_single, reduce_scatter_single
from wrapopt.hardware.timing import median, paired_difference, sync_for, time_reps

__all__ = ["measure_unit_overhead", "measure_param_overhead", "measure_byte_overhead", "measure_optimizer",
           "measure_pipeline_action"]


def _device() -> tuple[str, torch.device]:
    """The device type the ranks measure on and this rank's device."""
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    return dev_type, torch.device(dev_type, torch.cuda.current_device()) if dev_type == "cuda" else torch.device("cpu")


def _slowest(*values: float, device: torch.device) -> list[float]:
    """Each value's max over ranks (collective): the slowest rank's figure is what every rank waits for."""
    out = torch.tensor(values, dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.tolist()


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
    taken out (``t_many - t_one`` is the median of the two steps' differences,
    timed back to back per round: ``timing.paired_difference``). The cost
    model charges ``unit_overhead_s`` at each of a unit's all-gathers and at
    its reduction: 3 a step for a resharded unit (gather, re-gather, reduce),
    2 for the root, so "many" holds ``3N - 2`` more of them than "one"::
        per_event = (t_many - t_one - (2N - 1) * t_all_gather - (N - 1) * t_reduce_scatter) / (3N - 2)

    The result is ``per_event``, floored at 0 and the max over ranks, which
    reproduces the measured step: each charged event gets one share.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise ProfileError("measure_unit_overhead needs a process group; call it on every rank under torchrun or spawn")
    if num_layers < 2:
        raise ValueError(f"num_layers must be at least 2, got {num_layers}")
    world = dist.get_world_size()
    dev_type, device = _device()
    sync = sync_for(device)
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
    many, one = step_of(build(True)), step_of(build(False))
    n = num_layers
    estimates = []
    # Three estimates, the median kept: (2n - 1) all-gather latencies are taken out of each, so a
    # noisy all-gather timing moves one estimate by 31x its error, and one such estimate (floored at 0)
    # can put every unit's overhead at nothing.
    for _ in range(3):
        t_ag = time_reps(lambda: all_gather_single(full, shard), repeats=repeats * 4, warmup=warmup, sync=sync)
        t_rs = time_reps(lambda: reduce_scatter_single(shard, full), repeats=repeats * 4, warmup=warmup, sync=sync)
        # The two steps interleaved, their difference paired per round (a step is a few ms: rounds are
        # cheap); timed one after the other, the load's drift between them lands in the difference.
        many_minus_one = paired_difference(many, one, repeats=4 * repeats, warmup=warmup, sync=sync)
        estimates.append((many_minus_one - (2 * n - 1) * t_ag - (n - 1) * t_rs) / (3 * n - 2))
    # Ranks must agree: the slowest rank's overhead is what every rank waits for.
    return _slowest(max(median(estimates), 0.0), device=device)[0]


def measure_param_overhead(*, layers: tuple[int, int] = (4, 64), repeats: int = 5, warmup: int = 2) -> float:
    """Seconds FSDP2 adds per parameter tensor of a unit per all-gather or reduction; collective.

    [Note: per-parameter overhead] FSDP2's work per unit grows with its parameter count: the
    copy-out registers every unsharded parameter, the reduction makes every sharded gradient a
    DTensor. ``measure_unit_overhead`` times units of 2 parameters (``nn.Linear(8, 8)``), so a
    unit of many (a group of blocks, the root of a one-unit plan) pays more than 2 parameters'
    worth (``results/fsdp_in_step.md``). Here: a root-only model of
    ``layers[0]`` and of ``layers[1]`` layers (one all-gather and one reduce-scatter a step; the
    root is not resharded), each against the same layers without FSDP, paired per round; the
    difference of the two excesses over the difference in parameters, per collective (two a step).
    The messages are a few KiB, latency-bound alike. The cost model charges a unit
    ``unit_overhead_s + param_overhead_s x its parameters`` at each all-gather and reduction, and
    the profile's ``unit_overhead_s`` is ``measure_unit_overhead``'s less two parameters' worth.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise ProfileError("measure_param_overhead needs a process group; call it on every rank")
    dev_type, device = _device()
    sync = sync_for(device)
    mesh = init_device_mesh(dev_type, (dist.get_world_size(),))
    x = torch.randn(4, 8, device=device)

    def step(k: int, sharded: bool) -> Callable[[], None]:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(8, 8, device=device) for _ in range(k)))
        if sharded:
            fully_shard(model, mesh=mesh)
        return lambda: model(x).sum().backward()

    few, many = layers
    excess = [paired_difference(step(k, True), step(k, False), repeats=4 * repeats, warmup=warmup, sync=sync)
              for k in (few, many)]
    per_param = (excess[1] - excess[0]) / (2 * 2 * (many - few))  # 2 tensors a layer, 2 collectives a step
    return _slowest(max(per_param, 0.0), device=device)[0]


def measure_byte_overhead(*, width: int = 65536, repeats: int = 5, warmup: int = 2) -> float:
    """Seconds per gathered byte that FSDP2 adds to an all-gather beyond the collective itself
    (collective: every rank calls it).

    [Note: per-byte overhead] FSDP2's work per unit also grows with its bytes: the all-gather's
    copy-in, its output buffer allocated afresh, the copy-out into the unsharded parameters, and
    gloo's own buffer of the unsharded size (See [Note: collective copies] in cost/step.py); a
    reduction copies the gradients in and allocates its output alike. The fabric times the
    collective alone, on buffers allocated once, so a unit's bytes cost beyond it, at every
    gather and reduction. Here: a root-only unit of two
    bias-free ``Linear`` layers 8 wide and ``width`` wide (the same tensor count), forward
    without gradients (one all-gather each), each round timing, paired and in alternating order,
    ``fsdp(wide) + plain(narrow) + all-gather(narrow)`` against ``fsdp(narrow) + plain(wide) +
    all-gather(wide)``, a barrier before each part; the difference over the bytes between the
    two widths. The cost model charges it with ``param_overhead_s`` at each all-gather, re-gather
    and reduction (``Simulator._param_overhead``), on the unit's gathered bytes.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise ProfileError("measure_byte_overhead needs a process group; call it on every rank")
    dev_type, device = _device()
    sync = sync_for(device)
    world = dist.get_world_size()
    mesh = init_device_mesh(dev_type, (world,))
    x = torch.randn(4, 8, device=device)

    def forward(w: int, sharded: bool) -> Callable[[], None]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, w, bias=False, device=device), nn.Linear(w, 8, bias=False, device=device))
        if sharded:  # resharded after forward, the root too: one all-gather a forward
            fully_shard(m, mesh=mesh, reshard_after_forward=True)

        def run() -> None:
            dist.barrier()
            with torch.no_grad():
                m(x)
        return run

    def gather(w: int) -> Callable[[], None]:
        n = -(-2 * 8 * w // world) * world
        full, shard = torch.zeros(n, device=device), torch.zeros(n // world, device=device)

        def run() -> None:
            dist.barrier()
            all_gather_single(full, shard)
        return run

    fsdp = {w: forward(w, True) for w in (8, width)}
    plain = {w: forward(w, False) for w in (8, width)}
    ag = {w: gather(w) for w in (8, width)}

    def wide() -> None:
        fsdp[width](), plain[8](), ag[8]()

    def narrow() -> None:
        fsdp[8](), plain[width](), ag[width]()

    excess = paired_difference(wide, narrow, repeats=4 * repeats, warmup=warmup, sync=sync)
    per_byte = excess / (2 * 8 * (width - 8) * 4)  # the float32 bytes between the two widths
    return _slowest(max(per_byte, 0.0), device=device)[0]


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
    dev_type, device = _device()
    world = dist.get_world_size()
    sync = sync_for(device)

    def stepper(model: nn.Module, mesh: Any) -> Callable[[], Any]:
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        return opt.step

    def step_time(model: nn.Module, mesh: Any) -> float:
        return time_reps(stepper(model, mesh), repeats=repeats, warmup=2, sync=sync)

    def tiny() -> nn.Module:
        return nn.Sequential(*(nn.Linear(8, 8, device=device) for _ in range(num_tensors // 2)))

    mesh1 = init_device_mesh(dev_type, (world,))
    per_tensor_2d = 0.0
    if world > 1:  # the 2-D extra decides no-shard against one unit: timed interleaved with the 1-D
        # step and taken as the median paired ratio (sequential medians carry the load's drift between them)
        mesh2 = init_device_mesh(dev_type, (world, 1), mesh_dim_names=("replicate", "shard"))
        one, two = stepper(tiny(), mesh1), stepper(tiny(), mesh2)
        pairs = [(time_reps(one, repeats=1, warmup=0, sync=sync), time_reps(two, repeats=1, warmup=0, sync=sync))
                 for _ in range(2 + max(repeats, 9))][2:]
        per_tensor = median([a for a, _b in pairs]) / num_tensors
        per_tensor_2d = per_tensor * median([b / a for a, b in pairs])
    else:
        per_tensor = step_time(tiny(), mesh1) / num_tensors
    n = 4096 if dev_type == "cuda" else 1024
    big = nn.Sequential(*(nn.Linear(n, n, bias=False, device=device) for _ in range(4)))
    local_bytes = 4 * n * n * 4 / world
    t_big = step_time(big, mesh1) - 4 * per_tensor
    counted = 2 + 2 * 2  # bytes per parameter byte as cost/simulate.py counts AdamW (two states)
    bandwidth = local_bytes * counted / t_big if t_big > 0 else 0.0
    per_tensor, per_tensor_2d, neg_bw = _slowest(per_tensor, per_tensor_2d, -bandwidth, device=device)
    return per_tensor, per_tensor_2d, -neg_bw  # slowest rank: max time, min bandwidth


def measure_pipeline_action(*, repeats: int = 5, width: int = 8) -> float:
    """Host seconds per forward or backward action of torch's pipeline schedule; collective: every
    rank calls it (an even world of 2 to 8 ranks, one node's; else 0.0: a pair per 2 ranks would make
    hundreds of groups on a cluster). See [Note: pipeline actions] in cost/pipeline.py.

    Ranks pair up (2i, 2i + 1) as two stages of one ``nn.Linear(width, width)`` each, and step a
    ``Schedule1F1B`` of 2 and of 8 micro-batches of one row, interleaved (medians, the first steps
    dropped: shape inference). The 6 micro-batches more cost, each, a forward and a backward action
    on every rank plus the two sends on their path (an activation forward, a gradient back), timed
    as a ping-pong of one element between the pair::
        action = ((t8 - t2) / 6 - 2 * send) / 2
    floored at 0, the max over ranks.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if not dist.is_initialized():
        raise ProfileError("measure_pipeline_action needs a process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2 or world % 2 or world > 8:
        return 0.0
    dev_type, device = _device()
    sync = sync_for(device)
    groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]  # every rank makes every group
    group, stage_index, peer = groups[rank // 2], rank % 2, rank ^ 1

    def schedule(m: int) -> Callable[[], None]:
        torch.manual_seed(0)
        stage = PipelineStage(nn.Linear(width, width, device=device), stage_index, 2, device, group=group)
        sch = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, tgt: ((out - tgt) ** 2).mean())
        x, tgt = torch.randn(m, width, device=device), torch.randn(m, width, device=device)
        return (lambda: sch.step(x)) if stage_index == 0 else (lambda: sch.step(target=tgt))

    one = torch.zeros(1, device=device)

    def ping_pong() -> None:
        if stage_index == 0:
            dist.send(one, peer, group=group)
            dist.recv(one, peer, group=group)
        else:
            dist.recv(one, peer, group=group)
            dist.send(one, peer, group=group)

    short, long_ = schedule(2), schedule(8)
    pairs = []
    for r in range(3 + max(repeats, 5)):
        dist.barrier()
        t2 = time_reps(short, repeats=1, warmup=0, sync=sync)
        dist.barrier()
        t8 = time_reps(long_, repeats=1, warmup=0, sync=sync)
        if r >= 3:
            pairs.append((t2, t8))
    send = time_reps(ping_pong, repeats=4 * repeats, warmup=2, sync=sync) / 2
    slope = median([(t8 - t2) / 6 for t2, t8 in pairs])
    action = _slowest(max(0.0, (slope - 2 * send) / 2), device=device)[0]
    for g in groups:
        dist.destroy_process_group(g)
    return action
