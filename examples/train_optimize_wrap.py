"""One call under torchrun: profile, search, shard, then train.

    torchrun --nproc_per_node 2 examples/train_optimize_wrap.py --model gpt-tiny --save-plan plan.json
    torchrun --nproc_per_node 2 examples/train_optimize_wrap.py --model gpt-tiny --plan plan.json   # reuse it

``optimize_wrap`` measures the fabric with every rank (unless ``--fabric``
names a saved profile or an analytical fabric), searches on rank 0, sends the
plan to every rank, shards the model with it and hands it back, ready for the
optimizer. ``--plan`` skips the measuring and the search.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from wrapopt import optimize_wrap
from wrapopt.launch import dp_rank_size, init_from_env, run_rank_main
from wrapopt.models import zoo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny", help="a trainable zoo model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--fabric", default=None,
                        help="a saved fabric profile (wrapopt profile-fabric --out) or an analytical fabric name; "
                             "default: measure it now")
    parser.add_argument("--memory", default=None, help="per-rank memory budget, e.g. 2MiB")
    parser.add_argument("--save-plan", default=None, help="write the plan here (rank 0)")
    parser.add_argument("--plan", default=None, help="apply this saved plan instead of searching")
    parser.add_argument("--trials", type=int, default=None, help="the search's Optuna trials (default: wrapopt's)")
    args = parser.parse_args(argv)

    rank, world = init_from_env()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    entry = zoo.get_entry(args.model)
    model = entry.build(device, seed=0)
    res = optimize_wrap(model, entry.inputs(device=device), loss_fn=entry.loss, fabric=args.fabric,
                        memory_budget=args.memory, save_plan=args.save_plan, plan=args.plan, trials=args.trials)
    model = res.model  # sharded with fully_shard as the plan says
    if rank == 0:
        print(res.report(), flush=True)
        print("units: " + ", ".join(u.name for u in res.plan.units), flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dp_rank, dp_size = dp_rank_size(res.plan.mesh)  # a 2-D plan's tensor-parallel peers share one batch

    for step in range(args.steps):
        batch = entry.inputs(batch=entry.batch * dp_size, device=device)
        batch = tuple(t.roll(step, dims=0).chunk(dp_size)[dp_rank] for t in batch)
        with res.loss_context():  # loss parallel (a 2-D plan's tp.loss_parallel): logits split over the vocabulary
            loss = entry.loss(model(*batch), batch)
            loss.backward()
        if isinstance(loss, DTensor):  # loss parallel's loss is a replicated DTensor
            loss = loss.full_tensor()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {float(mean) / world:.5f}", flush=True)
    if rank == 0:
        print("done", flush=True)
    return 0


if __name__ == "__main__":
    run_rank_main(main)  # main(), then shutdown(): barrier, destroy the group; a WrapoptError is one line per rank
