"""The simulator's estimates for a fixed plan set (formerly ``benchmarks/estimate_dump.py``).

The set: the zoo's four tiny models and llama-7b, two meshes (2 ranks on one
node; 64 ranks, 8 per node, with HSDP shard groups), four option sets, a GPU
(analytical) and a CPU-like compute profile, every baseline and seeded random
plans of the Optuna search space, timelines for the baselines.

``test_golden.py`` compares it with ``estimates.golden.json``. The full dump, to
``cmp`` two checkouts or to read what changed:

    PYTHONPATH=$PWD python -m tests.golden.estimates --out /tmp/estimates.json
"""

from __future__ import annotations

import argparse
import json
import random

from tests.golden.digest import Entry, canonical_sha256
from wrapopt import ComputeProfile, MeshSpec, analytical_compute, analytical_fabric, trace_model, zoo
from wrapopt.cost import Simulator
from wrapopt.search.baselines import baselines
from wrapopt.search.study.space import SearchSpace
from wrapopt.spec import OptimizerKind, SimOptions

MODELS = ("gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny", "llama-7b")
MESHES = (dict(world_size=2, ranks_per_node=2, shard_size=2), dict(world_size=64, ranks_per_node=8, shard_size=8))
OPTIONS = (
    SimOptions(),
    SimOptions(param_dtype_bytes=2, reduce_dtype_bytes=4, grad_accumulation=4),
    SimOptions(optimizer=OptimizerKind.SGD_MOMENTUM, batch_scale=2.0),
    # --precision bf16 as users train (TrainConfig.preset("bf16").sim_options()): bf16 gathers and activations
    SimOptions(param_dtype_bytes=2, reduce_dtype_bytes=4, activation_dtype_bytes=2),
)
# The dtype each option set's model is traced in; None: the model's own. options[1] gathers in bf16 but keeps
# the activations as traced; options[3] traces in bf16, as the API and the CLI do under --precision bf16
# (See [Note: tracing in the compute dtype] in wrapopt/trace/record.py).
COMPUTE_DTYPES = (None, None, None, "bfloat16")


class _Random:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def cat(self, name, choices):
        return self.rng.choice(choices)


def _cpu_like() -> ComputeProfile:
    g = analytical_compute()
    return ComputeProfile(kind="measured", device="cpu", flops_per_s=4e10, memory_bandwidth_bytes_per_s=1e10,
                          memory_capacity_bytes=g.memory_capacity_bytes, unit_overhead_s=4e-4,
                          module_overhead_s=3e-5, optimizer_tensor_s=2e-5, loss_s=1e-3,
                          checkpoint_overhead_s=1e-4, runs_ahead=False)


def dump() -> list:
    """Rows ``[model, world_size, compute, options index, plan label, estimate JSON]``."""
    rows = []
    computes = (("gpu", analytical_compute()), ("cpu", _cpu_like()))
    for name in MODELS:
        entry = zoo.get_entry(name)
        graphs = {dt: trace_model(entry.build("meta"), entry.inputs(), loss_fn=entry.loss, fx=False, compute_dtype=dt)
                  for dt in dict.fromkeys(COMPUTE_DTYPES)}
        graph = graphs[None]
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
                    sim = Simulator(graphs[COMPUTE_DTYPES[k]], fabric, compute, opt)
                    for label, plan, record in plans:
                        est = sim.simulate(plan, record=record)
                        rows.append([name, m["world_size"], cname, k, label, est.to_json()])
    return rows


def entries(rows: list) -> list[Entry]:
    """The golden entries of ``dump()``'s rows (or of a full dump read back from JSON)."""
    out = []
    for row in rows:
        name, world, cname, k, label, est = row
        out.append(Entry(key=f"{name} x{world} {cname} options[{k}] {label}", step_s=repr(est["step_s"]),
                         peak_bytes=est["peak_bytes"], sha256=canonical_sha256(row)))
    return out


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
