"""Dump the simulator's estimates for a fixed plan set, to check that a refactor
changes no estimate (``cmp`` two dumps: they must be byte-identical).

The set: the zoo's four tiny models and llama-7b, two meshes (2 ranks on one
node; 64 ranks, 8 per node, with HSDP shard groups), three option sets, a GPU
(analytical) and a CPU-like compute profile, every baseline and seeded random
plans of the Optuna search space, timelines for the baselines.

    python benchmarks/estimate_dump.py --out /tmp/estimates.json
"""

from __future__ import annotations

import argparse
import json
import random

from wrapopt import ComputeProfile, MeshSpec, analytical_fabric, trace_model, zoo
from wrapopt.cost import Simulator

try:  # the layout after issue 18
    from wrapopt import analytical_compute
    from wrapopt.search.baselines import baselines
    from wrapopt.search.study.space import SearchSpace
    from wrapopt.spec import OptimizerKind, SimOptions
except ImportError:  # the layout before it
    from wrapopt.search import baselines  # type: ignore[no-redef]
    from wrapopt.search.space import SearchSpace  # type: ignore[no-redef]
    from wrapopt.types import OptimizerKind, SimOptions  # type: ignore[no-redef]

    analytical_compute = ComputeProfile.analytical  # type: ignore[attr-defined]

MODELS = ("gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny", "llama-7b")
MESHES = (dict(world_size=2, ranks_per_node=2, shard_size=2), dict(world_size=64, ranks_per_node=8, shard_size=8))
OPTIONS = (
    SimOptions(),
    SimOptions(param_dtype_bytes=2, reduce_dtype_bytes=4, grad_accumulation=4),
    SimOptions(optimizer=OptimizerKind.SGD_MOMENTUM, batch_scale=2.0),
)


class _Random:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def cat(self, name, choices):
        return self.rng.choice(choices)


def _cpu_like() -> ComputeProfile:
    g = analytical_compute()
    kw = dict(kind="measured", device="cpu", flops_per_s=4e10, memory_bandwidth_bytes_per_s=1e10,
              memory_capacity_bytes=g.memory_capacity_bytes, unit_overhead_s=4e-4, module_overhead_s=3e-5,
              optimizer_tensor_s=2e-5, loss_s=1e-3, checkpoint_overhead_s=1e-4)
    try:
        return ComputeProfile(**kw, runs_ahead=False)
    except TypeError:  # before issue 18 the CPU schedule came from the device's name
        return ComputeProfile(**kw)


def dump() -> list:
    rows = []
    computes = (("gpu", analytical_compute()), ("cpu", _cpu_like()))
    for name in MODELS:
        entry = zoo.get_entry(name)
        graph = trace_model(entry.build("meta"), entry.inputs(), loss_fn=entry.loss, fx=False)
        for m in MESHES:
            mesh = MeshSpec(**m)
            fabric = analytical_fabric(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node)
            base = baselines(graph, mesh)
            space = SearchSpace(graph, mesh)
            rng = random.Random(7)
            plans = [(label, p, True) for label, p in sorted(base.items())]
            plans += [(f"random-{i}", space.decode(_Random(rng)), False) for i in range(24)]
            for cname, compute in computes:
                for k, opt in enumerate(OPTIONS):
                    sim = Simulator(graph, fabric, compute, opt)
                    for label, plan, record in plans:
                        est = sim.simulate(plan, record=record)
                        rows.append([name, m["world_size"], cname, k, label, est.to_json()])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = dump()
    with open(args.out, "w") as f:
        json.dump(rows, f, sort_keys=True)
    print(f"{len(rows)} estimates -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
