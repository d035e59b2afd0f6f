"""Dump ``search_plan``'s answers on the searches the exact DP finds hardest, to
check that a refactor of the search changes no answer (``cmp`` the dumps of two
checkouts: they must be byte-identical). Too slow for a test; the small set is
the golden test ``tests/golden`` (``tests/golden/searches.py``).

The set: llama-7b and llama-70b on 64, 256 and 1024 ranks (8 per node), set up
as ``wrapopt search`` sets them up (the analytical fabric and its device, the
default training config), with no budget, the default (auto: 90% of the device)
and 40 and 60 GiB; no study (the study is seeded with the DP's answers, so
these pin what the DP proposes). Every DP answer (``candidates`` holds them all,
with their times).

    PYTHONPATH=$PWD python scripts/search_dump_big.py --out /tmp/search_big.json [--models llama-70b]
"""

from __future__ import annotations

import argparse
import time

from tests.golden.searches import result_row, write_dump
from wrapopt import MeshSpec, trace_model, zoo
from wrapopt.api import compute_for, resolve_budget, resolve_fabric
from wrapopt.cost import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.train import TrainConfig, model_dtype

BIG_MODELS = ("llama-7b", "llama-70b")
BIG_WORLDS = (64, 256, 1024)
BIG_BUDGETS = ("none", "auto", "40GiB", "60GiB")


def run_big(models: tuple[str, ...]) -> list[dict]:
    out = []
    train = TrainConfig()
    for name in models:
        model, inputs = zoo.build(name, "meta")
        graph = trace_model(model, inputs, loss_fn=zoo.ZOO[name].loss)
        for world in BIG_WORLDS:
            mesh = MeshSpec(world_size=world, ranks_per_node=8, shard_size=world)
            fabric = resolve_fabric(None, world_size=world, ranks_per_node=8)
            compute = compute_for(fabric, None, train, model_dtype(model))
            for word in BIG_BUDGETS:
                budget = resolve_budget(word, compute)
                sim = Simulator(graph, fabric, compute, train.sim_options(memory_budget=budget))
                row: dict = {"model": name, "world": world, "budget": word, "trials": 0}
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    res = search_plan(graph, sim, mesh, memory_budget=budget, options=SearchOptions(trials=0, seed=0))
                except InfeasibleError as e:
                    row["infeasible"] = str(e)
                else:
                    row.update(result_row(res))
                print(f"{name} w{world} budget={word}: {time.perf_counter() - t0:.1f}s wall, "
                      f"{time.process_time() - c0:.1f}s CPU", flush=True)
                out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=None, help=f"default: {','.join(BIG_MODELS)}")
    args = ap.parse_args()
    write_dump(run_big(tuple(args.models.split(",")) if args.models else BIG_MODELS), args.out)


if __name__ == "__main__":
    main()
