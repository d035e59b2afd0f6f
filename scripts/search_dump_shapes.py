"""Dump ``run_search``'s answers over the parallel shapes (tensor, pipeline, a fixed global
batch, and their combinations), to check that a refactor of the shape search changes no answer:
``cmp`` the dumps of two checkouts, they must be identical. The golden files pin the 1-D search
(``tests/golden``); this pins what ``search/shapes.py``, ``run.py``, ``tp.py``, ``batch.py``, ``axes.py`` and
``pipeline*.py`` make of it: per request the best plan, its step and peak, the ``why``, the notes,
every row the report prints (tp, pipeline, batch splits), the degrees tried with their outcome, the
training step and the simulator options of the answer. About two minutes.

    PYTHONPATH=$PWD python scripts/search_dump_shapes.py --out /tmp/shapes.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from wrapopt import zoo
from wrapopt.errors import WrapoptError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.job import prepare
from wrapopt.search.baselines import baselines
from wrapopt.search.driver import SearchOptions
from wrapopt.search.run import run_search
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.train import TrainConfig

# (model, world, ranks per node, request axes, Optuna trials, budget: None, bytes, or "tight": 80% of per-block's peak)
CASES = [
    ("llama-tiny", 8, 8, dict(tp="auto"), 0, None),
    ("llama-tiny", 8, 8, dict(tp="auto"), 8, None),
    ("llama-tiny", 8, 8, dict(pp="auto"), 0, None),
    ("llama-tiny", 8, 8, dict(pp="auto", tp="auto"), 0, None),
    ("llama-tiny", 8, 8, dict(pp=2, tp=2), 0, None),
    ("llama-tiny", 8, 8, dict(global_batch=32), 0, None),
    ("llama-tiny", 8, 8, dict(global_batch=32, tp="auto"), 4, None),
    ("llama-tiny", 8, 8, dict(global_batch=32, pp="auto"), 0, None),
    ("llama-tiny", 8, 8, dict(global_batch=32, pp="auto", tp="auto"), 0, None),
    ("llama-tiny", 8, 8, dict(global_batch=32, tp=2), 6, None),
    ("llama-tiny", 8, 8, dict(tp=2), 6, None),
    ("llama-tiny", 8, 4, dict(tp="auto"), 6, "tight"),
    ("gpt-tiny", 4, 4, dict(pp="auto"), 0, "tight"),
    ("gpt-tiny", 4, 4, dict(global_batch=16, pp="auto"), 0, "tight"),
    ("llama-7b", 64, 8, dict(tp="auto", global_batch=256), 0, 72 * 2**30),
    ("llama-7b", 64, 8, dict(tp="auto", pp="auto"), 0, 72 * 2**30),
    ("llama-7b", 64, 8, dict(tp="auto", pp="auto", global_batch=512), 0, 72 * 2**30),
    ("llama-tiny", 8, 8, dict(cp="auto"), 0, None),
    ("llama-tiny", 8, 8, dict(cp=2, tp=2), 4, None),
    ("llama-tiny", 8, 8, dict(cp="auto", tp="auto"), 0, "tight"),
    ("llama-tiny", 8, 8, dict(cp="auto", global_batch=8), 0, "tight"),
    ("llama-tiny", 8, 8, dict(pp=2, cp="auto"), 0, None),
    ("llama-tiny", 8, 8, dict(pp="auto", cp="auto", tp="auto"), 0, "tight"),
    ("moe-tiny", 8, 8, dict(ep="auto"), 0, None),
    ("moe-tiny", 8, 8, dict(ep="auto"), 4, "tight"),
    ("moe-tiny", 8, 8, dict(ep=2), 0, None),
    ("moe-tiny", 8, 8, dict(ep="auto", global_batch=16), 0, None),
    ("moe-tiny", 8, 8, dict(ep=4, global_batch=32), 0, "tight"),
    ("moe-tiny", 8, 8, dict(ep="auto", pp="auto"), 0, None),
    ("moe-tiny", 8, 8, dict(ep=2, pp=2), 0, "tight"),
    ("moe-tiny", 8, 8, dict(ep="auto", pp="auto", global_batch=32), 0, None),
    ("llama-tiny", 8, 8, dict(pp="auto", cp="auto", global_batch=32), 0, None),
    ("moe-tiny", 8, 8, dict(cp="auto", ep="auto"), 0, "tight"),
    ("moe-tiny", 8, 8, dict(cp="auto", ep="auto", pp="auto"), 0, None),
]


def _row(s) -> list | None:  # noqa: ANN001
    return None if s is None else [s.plan.label, repr(s.estimate.step_s), s.estimate.peak_bytes, s.fits]


def dump_case(name: str, world: int, per_node: int, axes: dict, trials: int, budget) -> dict:  # noqa: ANN001
    model, x = zoo.build(name, "meta")
    mesh = MeshSpec(world_size=world, ranks_per_node=per_node, shard_size=world)
    train = TrainConfig.preset("bf16") if name == "llama-7b" else TrainConfig()
    request = ParallelRequest(mesh=mesh, train=train, memory_budget=budget if isinstance(budget, int) else "none",
                              **axes)
    job = prepare(request, model, x, fabric=analytical_fabric(world_size=world, ranks_per_node=per_node),
                  compute=analytical_compute())
    limit = job.budget
    if budget == "tight":
        limit = 0.8 * job.sim.simulate(baselines(job.graph, mesh)["per-block"]).peak_bytes
    try:
        found = run_search(job.graph, job.sim, job.request, memory_budget=limit, options=SearchOptions(trials=trials))
    except (WrapoptError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    res = found.result
    return dict(best=_row(res.best), why=res.why, notes=[*found.notes, *res.notes],
                tp_rows=[[label, _row(s)] for label, s in res.tp_rows], tp_tried=[list(t) for t in res.tp_tried],
                tp_chosen=res.tp_chosen, pp_rows=[[label, _row(s)] for label, s in res.pp_rows],
                pp_tried=[list(t) for t in res.pp_tried],
                batch_rows=[[b.split.describe(), _row(b.best), b.searched, b.chosen] for b in res.batch_rows],
                train=found.train.to_json(), candidates=len(res.candidates),
                batch_scale=found.sim.options.batch_scale, accumulation=found.sim.options.grad_accumulation)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where to write the dump (JSON)")
    args = p.parse_args(argv)
    out = {}
    for case in CASES:
        t0 = time.perf_counter()
        key = f"{case[0]} x{case[1]}/{case[2]} {case[3]} trials={case[4]} budget={case[5]}"
        out[key] = dump_case(*case)
        print(f"{time.perf_counter() - t0:6.1f} s  {key}", file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
