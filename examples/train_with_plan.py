"""Plain PyTorch training with a saved wrapopt plan (FSDP2).

Make a plan once, then train with it on 2 CPU ranks (gloo) or GPUs (NCCL):

    wrapopt search zoo:gpt-tiny --world-size 2 --out plan.json     # or `make demo`: results/demo-latest/plan.json
    torchrun --nproc_per_node 2 examples/train_with_plan.py --plan plan.json
    torchrun --nproc_per_node 2 examples/train_with_plan.py --plan plan.json --meta-init

``--meta-init`` builds the model on the meta device (no weights), shards it,
and only then gives it storage and initial values, the way models too large
for one device are built. Every rank loads and checks the plan before any
collective, so a wrong plan stops every rank with the same message.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from wrapopt import WrapPlan
from wrapopt.debug import full_tensor, memory_report
from wrapopt.launch import dp_rank_size, init_from_env, run_rank_main
from wrapopt.models import zoo
from wrapopt.plan.apply import materialize_sharded


def init_weights(module: nn.Module) -> None:
    """Initialise one module's own parameters (what ``materialize_sharded`` calls per module)."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif isinstance(module, zoo.RMSNorm):
        nn.init.ones_(module.weight)
    elif isinstance(module, zoo.ViT):
        nn.init.zeros_(module.cls_token)
        nn.init.zeros_(module.pos_embed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="a plan file from `wrapopt search ... --out`")
    trainable = ", ".join(n for n, e in zoo.ZOO.items() if e.trainable)
    parser.add_argument("--model", default="gpt-tiny", help=f"a trainable zoo model ({trainable})")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--meta-init", action="store_true", help="build on meta, shard, then materialise")
    args = parser.parse_args(argv)

    rank, world = init_from_env()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    entry = zoo.get_entry(args.model)
    plan = WrapPlan.load(args.plan)  # every rank reads it: a bad file fails everywhere, before any collective

    if args.meta_init:
        model = entry.build("meta")
        plan.apply(model)  # checks the model's fingerprint, then fully_shard bottom-up
        torch.manual_seed(args.seed)  # the same on every rank: each keeps its own shard of the same values
        materialize_sharded(model, device=device, init_fn=init_weights)
    else:
        model = entry.build(device, seed=args.seed)
        plan.apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dp_rank, dp_size = dp_rank_size(plan.mesh)  # a 2-D plan's tensor-parallel peers share one batch

    for step in range(args.steps):
        # Each rank trains on its own slice of one global batch, new data every step.
        batch = entry.inputs(batch=entry.batch * dp_size, device=device)
        batch = tuple(t.roll(step, dims=0).chunk(dp_size)[dp_rank] for t in batch)
        with plan.loss_context():  # loss parallel (a 2-D plan's tp.loss_parallel): logits split over the vocabulary
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

    name = next(n for n, _ in model.named_parameters())
    w = full_tensor(model, name)  # collective: every rank gathers the same full tensor
    report = memory_report(model, optimizer)  # collective: each rank's figures in one table
    if rank == 0:
        print(f"{name}: shape {tuple(w.shape)}, norm {float(w.norm()):.4f}")
        print(report)
        print("done", flush=True)
    return 0


if __name__ == "__main__":
    run_rank_main(main)  # main(), then shutdown(): barrier, destroy the group; a WrapoptError is one line per rank
