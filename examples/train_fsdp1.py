"""Training with FSDP1 (FullyShardedDataParallel), wrapped as a wrapopt plan says.

    wrapopt search zoo:gpt-tiny --world-size 2 --out plan.json
    torchrun --nproc_per_node 2 examples/train_fsdp1.py --plan plan.json

``plan.to_fsdp1_policy()`` wraps exactly the plan's units, each with the
sharding strategy its ``reshard_after_forward`` maps to; the checkpointed
units get activation checkpointing after wrapping. What FSDP1 cannot express
(grouped units, resharding to groups of N ranks, prefetch deeper than one
unit) is said in a warning; ``--split-groups`` wraps each module of a grouped
unit on its own instead of stopping.
"""

from __future__ import annotations

import argparse
import functools
import warnings

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from wrapopt import WrapPlan
from wrapopt.fingerprint import strip_wrapper_prefixes
from wrapopt.launch import init_from_env, run_rank_main
from wrapopt.models import zoo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="a plan file from `wrapopt search ... --out`")
    parser.add_argument("--model", default="gpt-tiny", help="a trainable zoo model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--split-groups", action="store_true", help="wrap each module of a grouped unit on its own")
    args = parser.parse_args(argv)

    rank, world = init_from_env()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    entry = zoo.get_entry(args.model)
    plan = WrapPlan.load(args.plan)
    model = entry.build(device, seed=0)
    plan.check_model(model)  # local: a plan for another model fails on every rank, before FSDP starts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy = plan.to_fsdp1_policy(split_groups=args.split_groups)
    if rank == 0:
        for w in caught:
            print(f"note: {w.message}", flush=True)
    model = FSDP(model, auto_wrap_policy=policy, device_id=device, **policy.root_kwargs)
    if any(u.checkpoint for u in plan.units):
        apply_activation_checkpointing(
            model, check_fn=plan.fsdp1_checkpoint_fn(model),
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        )
    if rank == 0:
        units = [strip_wrapper_prefixes(n) or "<root>" for n, m in model.named_modules() if isinstance(m, FSDP)]
        print(f"FSDP1 units: {', '.join(units)}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    for step in range(args.steps):
        batch = entry.inputs(batch=entry.batch * world, device=device)
        batch = tuple(t.roll(step, dims=0).chunk(world)[rank] for t in batch)
        loss = entry.loss(model(*batch), batch)
        loss.backward()
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
