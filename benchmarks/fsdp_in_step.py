"""Where FSDP2's step on CPU gloo ranks spends the time the simulator does not price (issue 34).

The FSDP plans of ``make demo`` and ``results/fidelity*.md`` run 1.15-1.4x their
prediction on this VM while the plain model's compute matches its profile. This
benchmark takes the step apart on 2 ranks, each figure against the piece the cost
model prices it as, all interleaved per round:

1. **Phases against the plain model**: forward (with the loss) and backward of the
   plain model, of no-shard (FSDP2 on a (2, 1) mesh) and of root-only (one unit
   sharded over both ranks), per zoo model. The model prices no-shard as the plain
   step plus one unit overhead each way and an all-reduce; root-only as plus an
   all-gather, a reduce-scatter and a unit overhead each.
2. **The root-only forward taken apart**: ``unshard()`` alone (priced: the
   all-gather + the unit overhead), then the forward on the unsharded parameters
   (priced: the plain forward), and an all-gather of the model's size after a
   barrier (as the fabric measures it) and right after the plain forward.
3. **A collective right after compute**: all-gather, reduce-scatter and
   all-reduce after a barrier and after ``--busy-ms`` of matmuls (no barrier between).
4. **FSDP2's cost per parameter**: root-only models of 4-64 ``Linear(8, 8)`` layers
   against the plain ones; the unit overhead the profile measures uses 2-parameter units.

Medians (and means) over ``--repeats`` rounds of the slowest rank. Writes
``results/fsdp_in_step.md`` and ``.json``. Usage::

    python -m benchmarks.fsdp_in_step [--models gpt-tiny,llama-tiny] [--repeats 30] [--busy-ms 8]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch

from wrapopt.fileio import atomic_write_json, atomic_write_text
from wrapopt.launch import spawn

SIZES_MIB = (0.25, 1.0, 2.0)
LAYERS = (4, 16, 32, 64)


def _rounds(fns: list[Callable[[], None]], parts: dict[str, list[float]], repeats: int, warmup: int = 3) -> dict:
    """Each function once per round, a barrier before each; each records its parts' milliseconds into
    ``parts``. Returns the parts of the timed rounds, max over ranks per round."""
    import torch.distributed as dist

    for f in fns:
        for _ in range(warmup):
            f()
    for v in parts.values():
        v.clear()
    for _ in range(repeats):
        for f in fns:
            dist.barrier()
            f()
    keys = list(parts)
    out = torch.tensor([parts[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return {k: out[i].tolist() for i, k in enumerate(keys)}


def _timer(parts: dict[str, list[float]]) -> Callable[[str, Callable[[], Any]], Any]:
    """``timed(key, fn)``: run ``fn``, add its milliseconds to ``parts[key]``, return its result."""
    def timed(key: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        r = fn()
        parts.setdefault(key, []).append((time.perf_counter() - t0) * 1e3)
        return r
    return timed


def _model_parts(name: str, repeats: int) -> dict[str, list[float]]:
    """Parts 1 and 2 for one zoo model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wrapopt.models import zoo

    e = zoo.get_entry(name)
    inputs = e.inputs(device="cpu")
    world = dist.get_world_size()
    plain = e.build("cpu", seed=0)
    noshard = fully_shard(e.build("cpu", seed=0), mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("r", "s")))
    root = fully_shard(e.build("cpu", seed=0), mesh=init_device_mesh("cpu", (world,)))
    n = sum(p.numel() for p in plain.parameters()) // world * world
    full, shard = torch.zeros(n), torch.zeros(n // world)
    parts: dict[str, list[float]] = {}
    timed = _timer(parts)

    def step(label: str, m: Any) -> Callable[[], None]:
        def run() -> None:
            loss = timed(f"{label} forward", lambda: e.loss(m(*inputs), inputs))
            timed(f"{label} backward", loss.backward)
            m.zero_grad(set_to_none=True)
        return run

    def taken_apart() -> None:
        timed("root-only unshard()", root.unshard)
        loss = timed("root-only forward after unshard()", lambda: e.loss(root(*inputs), inputs))
        loss.backward()
        root.zero_grad(set_to_none=True)

    def gathers() -> None:
        timed("all-gather of the model, after a barrier", lambda: dist.all_gather_into_tensor(full, shard))
        dist.barrier()
        loss = e.loss(plain(*inputs), inputs)
        timed("all-gather of the model, after the plain forward", lambda: dist.all_gather_into_tensor(full, shard))
        loss.backward()
        plain.zero_grad(set_to_none=True)

    fns = [step("plain", plain), step("no-shard", noshard), step("root-only", root), taken_apart, gathers]
    return _rounds(fns, parts, repeats)


def _collectives(repeats: int, busy_ms: float) -> dict[str, list[float]]:
    """Part 3: each collective after a barrier and after ``busy_ms`` of matmuls."""
    import torch.distributed as dist

    a, b = torch.randn(128, 128), torch.randn(128, 128)
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.05:
        torch.mm(a, b)
        k += 1
    iters = max(1, int(k * busy_ms / 50))
    world = dist.get_world_size()
    parts: dict[str, list[float]] = {}
    timed = _timer(parts)
    fns = []
    for mib in SIZES_MIB:
        n = int(mib * 2**20 / 4) // world * world
        full, shard = torch.zeros(n), torch.zeros(n // world)
        for name, c in (("all-gather", lambda f=full, s=shard: dist.all_gather_into_tensor(f, s)),
                        ("reduce-scatter", lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f)),
                        ("all-reduce", lambda f=full: dist.all_reduce(f))):
            def run(c: Callable[[], Any] = c, key: str = f"{name} {mib:g} MiB") -> None:
                timed(f"{key}, after a barrier", c)
                dist.barrier()
                for _ in range(iters):
                    torch.mm(a, b)
                timed(f"{key}, after compute", c)
            fns.append(run)
    return _rounds(fns, parts, repeats)


def _per_parameter(repeats: int) -> dict[str, list[float]]:
    """Part 4: root-only ``fully_shard`` of k ``Linear(8, 8)`` layers against the plain ones."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(4, 8)
    parts: dict[str, list[float]] = {}
    timed = _timer(parts)
    fns = []
    for k in LAYERS:
        for sharded in (False, True):
            torch.manual_seed(0)
            m = nn.Sequential(*(nn.Linear(8, 8) for _ in range(k)))
            if sharded:
                fully_shard(m, mesh=mesh)
            key = f"{'root-only' if sharded else 'plain'} {k} layers"
            fns.append(lambda m=m, key=key: timed(key, lambda: m(x).sum().backward()))
    return _rounds(fns, parts, repeats)


def worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"models": {name: _model_parts(name, cfg["repeats"]) for name in cfg["models"]},
                           "collectives": _collectives(cfg["repeats"], cfg["busy_ms"]),
                           "per_parameter": _per_parameter(cfg["repeats"])}
    return out if rank == 0 else None


def _med(v: list[float]) -> float:
    return statistics.median(v)


def render(res: dict[str, Any], cfg: dict[str, Any], wall: float) -> str:
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"# FSDP2's step on CPU gloo ranks, taken apart (issue 34)", "",
             f"Machine: {platform.node()}, {os.cpu_count()} cores, no GPU; backend gloo, world size 2, one thread "
             f"per rank; torch {torch.__version__}; {date}. Regenerate: `python -m benchmarks.fsdp_in_step "
             f"--models {','.join(cfg['models'])} --repeats {cfg['repeats']} --busy-ms {cfg['busy_ms']:g}` "
             f"({wall:.0f} s). Every figure: median (mean) over {cfg['repeats']} rounds of the slowest rank's time, "
             "milliseconds; the pieces of a round interleaved, a barrier before each. What each part measures: "
             "the module docstring.", ""]
    for name, r in res["models"].items():
        m = {k: (_med(v), statistics.mean(v)) for k, v in r.items()}
        lines += [f"## {name}: phases against the plain model", "", "| | forward (with the loss) | backward |",
                  "|---|---|---|"]
        for label in ("plain", "no-shard", "root-only"):
            f, b = m[f"{label} forward"], m[f"{label} backward"]
            lines.append(f"| {label} | {f[0]:.2f} ({f[1]:.2f}) | {b[0]:.2f} ({b[1]:.2f}) |")
        lines += ["", "| root-only forward, taken apart | ms |", "|---|---|"]
        for k in ("root-only unshard()", "root-only forward after unshard()",
                  "all-gather of the model, after a barrier", "all-gather of the model, after the plain forward"):
            lines.append(f"| {k} | {m[k][0]:.2f} ({m[k][1]:.2f}) |")
        lines.append("")
    c = {k: (_med(v), statistics.mean(v)) for k, v in res["collectives"].items()}
    lines += [f"## A collective after a barrier and right after {cfg['busy_ms']:g} ms of compute", "",
              "| collective | after a barrier | after compute |", "|---|---|---|"]
    for k in c:
        if k.endswith("after a barrier"):
            base = k[: -len(", after a barrier")]
            a, b = c[k], c[f"{base}, after compute"]
            lines.append(f"| {base} | {a[0]:.2f} ({a[1]:.2f}) | {b[0]:.2f} ({b[1]:.2f}) |")
    p = {k: _med(v) for k, v in res["per_parameter"].items()}
    lines += ["", "## FSDP2's cost per parameter: root-only against plain", "",
              "| Linear(8, 8) layers | parameters | plain | root-only | root-only - plain |", "|---|---|---|---|---|"]
    for k in LAYERS:
        a, b = p[f"plain {k} layers"], p[f"root-only {k} layers"]
        lines.append(f"| {k} | {2 * k} | {a:.2f} | {b:.2f} | {b - a:.2f} |")
    lo, hi = LAYERS[0], LAYERS[-1]
    slope = ((p[f"root-only {hi} layers"] - p[f"plain {hi} layers"]) - (p[f"root-only {lo} layers"]
             - p[f"plain {lo} layers"])) / (2 * (hi - lo))
    lines += ["", f"Slope between {lo} and {hi} layers: {slope * 1e3:.1f} us per parameter per step (one all-gather, "
              "one reduce-scatter).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-tiny,llama-tiny")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--busy-ms", type=float, default=8.0)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    cfg = {"models": [m for m in args.models.split(",") if m], "repeats": args.repeats, "busy_ms": args.busy_ms}
    t0 = time.perf_counter()
    res = spawn(worker, world_size=2, args=(cfg,), timeout_s=1800)[0]
    wall = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    atomic_write_json(os.path.join(args.out, "fsdp_in_step.json"), {"config": cfg, "wall_s": wall, **res})
    text = render(res, cfg, wall)
    atomic_write_text(os.path.join(args.out, "fsdp_in_step.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
