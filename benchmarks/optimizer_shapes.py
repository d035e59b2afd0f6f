"""AdamW step time on fully_shard parameters: measured vs the cost model's optimizer term.

The profiler calibrates the optimizer on 32 tiny (8x8) tensors for the per-tensor
cost and on four 1024x1024 tensors for the bandwidth (``measure_optimizer``);
the simulator charges ``tensors * per_tensor + local bytes * 6 / bandwidth``.
This script times AdamW on other shapes in the same ranks and prints both.
Writes results/optimizer_shapes.md.

    python benchmarks/optimizer_shapes.py   # about a minute, 2 gloo ranks
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from wrapopt.fileio import atomic_write_text  # noqa: E402


def _worker(rank: int, world: int) -> list[tuple[str, int, float, float]] | None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wrapopt.hardware.measure_device import measure_optimizer
    from wrapopt.models import zoo

    per_tensor, _per_tensor_2d, bandwidth = measure_optimizer(repeats=5)
    mesh = init_device_mesh("cpu", (world,))
    rows = []

    def timed(label: str, model: nn.Module) -> None:
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        params = list(model.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        ts = []
        for _ in range(12):
            t0 = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(ts[2:])], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        local_bytes = sum(p.numel() * p.element_size() for p in params) / world
        predicted = len(params) * per_tensor + local_bytes * 6 / bandwidth
        rows.append((label, len(params), t.item(), predicted))

    timed("16 x Linear(8, 8) (the calibration's own shapes)", nn.Sequential(*(nn.Linear(8, 8) for _ in range(16))))
    timed("16 x Linear(64, 64)", nn.Sequential(*(nn.Linear(64, 64) for _ in range(16))))
    timed("16 x Linear(256, 256)", nn.Sequential(*(nn.Linear(256, 256) for _ in range(16))))
    for name in ("gpt-tiny", "t5-tiny"):
        timed(f"zoo:{name}", zoo.get_entry(name).build("cpu", seed=0))
    return rows if rank == 0 else None


def main() -> int:
    from wrapopt.launch import spawn

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    rows = spawn(_worker, world_size=2, timeout_s=600, env={"KINETO_LOG_LEVEL": "5"})[0]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = ["# AdamW on fully_shard parameters: measured vs the cost model's optimizer term", "",
             f"Machine: {platform.node()}, {os.cpu_count()} cores ({platform.machine()}), no GPU; backend gloo, 2 ranks, "
             f"one thread per rank; torch {torch.__version__}; {date}. Regenerate: `python benchmarks/optimizer_shapes.py` "
             f"({time.perf_counter() - t0:.0f} s). Median of 10 steps after 2, slowest rank; the model's figure uses "
             "`measure_optimizer` run on the same ranks just before.", "",
             "| parameters | tensors | measured step (ms) | cost model (ms) | measured / model |", "|---|---|---|---|---|"]
    lines += [f"| {label} | {n} | {meas * 1e3:.1f} | {pred * 1e3:.1f} | {meas / pred:.2f} |" for label, n, meas, pred in rows]
    os.makedirs("results", exist_ok=True)
    atomic_write_text(os.path.join("results", "optimizer_shapes.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
