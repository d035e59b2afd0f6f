"""Issue 51: the CPU step model's per-plan terms on a held-out family (zoo:mha-tied), paired.

On 2 gloo ranks: the compute profile measured twice on the same ranks, on the freshly built model
(as ``evaluate`` measures it) and on a copy stepped ``--settle`` times by AdamW (the state the
bench's timed steps run in), then a few plans that isolate one term each, all stepped interleaved
(``measure_plans``), against the simulator under both profiles:

- ``per-block``; ``[7 keep]+1``: a merged unit kept unsharded after forward (no backward
  re-gather, 6 fewer units); ``[7 keep]+1 ckpt``: the issue's shape, its last block
  checkpointed; ``per-block,ckpt-1``: one checkpointed block, per-block otherwise.

Each plan is reported as its step over per-block's (measured: median of per-round ratios), beside
the predicted ratio under each profile, with the phases.

    python -m benchmarks.heldout_terms [--model mha-tied] [--repeats 15] [--settle 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch

from wrapopt.fileio import atomic_write_json
from wrapopt.models import zoo


def _plans(graph, mesh):
    from wrapopt.search.baselines import baselines
    from wrapopt.spec import PlanSpec, UnitSpec

    base = baselines(graph, mesh)
    root = base["per-block"].units[-1]
    blocks = [b for c in graph.block_chains for b in c]
    head, last = tuple(blocks[:-1]), (blocks[-1],)
    one = tuple(UnitSpec((b,), True, False) for b in head)
    return [
        base["per-block"],
        PlanSpec((UnitSpec(head, False, False), UnitSpec(last, True, False), root), mesh, label="[n-1 keep]+1"),
        PlanSpec((UnitSpec(head, False, False), UnitSpec(last, True, True), root), mesh, label="[n-1 keep]+1 ckpt"),
        PlanSpec(one + (UnitSpec(last, True, True), root), mesh, label="per-block,ckpt-1"),
    ]


def _worker(rank: int, world: int, cfg: dict) -> dict | None:
    import torch.distributed as dist

    from wrapopt.evaluation.bench import measure_plans
    from wrapopt.hardware.compute_profile import ComputeProfile
    from wrapopt.hardware.measure_collectives import measure_fabric
    from wrapopt.hardware.measure_device import measure_compute
    from wrapopt.launch import broadcast_json
    from wrapopt.job import prepare
    from wrapopt.spec import MeshSpec, ParallelRequest

    entry = zoo.get_entry(cfg["model"])
    inputs = entry.inputs()
    fabric = measure_fabric(sizes_bytes=tuple(4 ** k * 1024 for k in range(0, 8)), repeats=15, progress=False,
                            ranks_per_node=world)
    fresh = entry.build("cpu", seed=0)
    settled = copy.deepcopy(fresh)
    opt = torch.optim.AdamW(settled.parameters(), lr=1e-3)
    for _ in range(cfg["settle"]):
        entry.loss(settled(*inputs), inputs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    profiles = {}
    for name, model in (("fresh", fresh), ("settled", settled)):
        c = measure_compute(model=model, example_inputs=inputs, loss_fn=entry.loss, repeats=5)
        profiles[name] = broadcast_json(c.to_json(), ComputeProfile.from_json)
    mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)
    sims = {}
    graph = None
    for name, comp in profiles.items():
        job = prepare(ParallelRequest(mesh=mesh, memory_budget="none"), entry.build("meta"), inputs, fabric=fabric,
                      compute=comp, loss_fn=entry.loss, graph=graph)
        graph, sims[name] = job.graph, job.sim
    plans = _plans(graph, mesh)
    measured = measure_plans(lambda: entry.build("cpu", seed=0), plans, inputs, entry.loss, repeats=cfg["repeats"],
                             warmup=cfg["settle"], measure_memory=False)
    dist.barrier()
    if rank != 0:
        return None
    base = measured[0].times_s
    rows = []
    for p, m in zip(plans, measured):
        row = {"plan": p.label, "meas_step_s": m.step_s, "meas_phase_s": list(m.phase_s),
               "meas_ratio": statistics.median(a / b for a, b in zip(m.times_s, base))}
        for name, sim in sims.items():
            e, e0 = sim.simulate(p), sim.simulate(plans[0])
            row[f"pred_{name}_step_s"] = e.step_s
            row[f"pred_{name}_phase_s"] = [e.fwd_s, e.step_s - e.fwd_s - e.optim_s, e.optim_s]
            row[f"pred_{name}_ratio"] = e.step_s / e0.step_s
        rows.append(row)
    return {"model": cfg["model"], "rows": rows, "torch": torch.__version__, "backend": dist.get_backend(),
            "world_size": world, "settle": cfg["settle"], "repeats": cfg["repeats"],
            "profiles": {k: v.to_json() for k, v in profiles.items()}}


def main(argv: list[str] | None = None) -> int:
    from wrapopt.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mha-tied")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--settle", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = {"model": args.model, "repeats": args.repeats, "settle": args.settle}
    res = spawn(_worker, world_size=2, args=(cfg,), timeout_s=3000)[0]
    print(f"{'plan':22s} {'meas/pb':>8s} {'fresh':>7s} {'settled':>8s}  meas fwd/bwd/opt ms | "
          "fresh fwd/bwd/opt | settled fwd/bwd/opt")
    for r in res["rows"]:
        ph = lambda xs: "/".join(f"{x * 1e3:.0f}" for x in xs)  # noqa: E731
        print(f"{r['plan']:22s} {r['meas_ratio']:8.3f} {r['pred_fresh_ratio']:7.3f} {r['pred_settled_ratio']:8.3f}  "
              f"{ph(r['meas_phase_s'])} | {ph(r['pred_fresh_phase_s'])} | {ph(r['pred_settled_phase_s'])}")
    if args.out:
        atomic_write_json(args.out, res)
    print(json.dumps({k: v for k, v in res.items() if k not in ("rows", "profiles")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
