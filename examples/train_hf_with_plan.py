"""A Hugging Face model trained with a saved wrapopt plan (FSDP2); no download.

The model is a tiny Llama built from a config in this file. Search a plan
for it offline (no process group, the analytical fabric), then train:

    python examples/train_hf_with_plan.py --write-plan plan_hf.json
    torchrun --nproc_per_node 2 examples/train_hf_with_plan.py --plan plan_hf.json

Needs ``pip install transformers``. Every rank checks the plan against the
model (parameter names, shapes, module classes) before any collective.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from wrapopt import WrapPlan
from wrapopt.launch import dp_rank_size, init_from_env, run_rank_main

VOCAB, SEQ, BATCH = 256, 32, 4  # per-rank batch


def build_model(device: str | torch.device = "cpu", seed: int = 0):
    """A 4-layer Llama, hidden size 64: the same weights for the same seed."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def batch_for(step: int, rank: int, world: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)  # the same global batch on every rank; each takes its slice
    return torch.randint(0, VOCAB, (BATCH * world, SEQ), generator=g).chunk(world)[rank].to(device)


def write_plan(path: str, world_size: int, memory: str | None = None) -> None:
    """Trace on meta, search on the analytical fabric, save: no process group needed.

    Without ``memory`` the budget is midway between the smallest and the
    largest predicted peak of the baselines, so that the plan has to shard
    (this model is small enough to fit anywhere unsharded).
    """
    from wrapopt.api import ParallelRequest, plan_model, prepare
    from wrapopt.fileio import fmt_bytes, parse_bytes
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric
    from wrapopt.search.driver import SearchOptions
    from wrapopt.spec import MeshSpec
    from wrapopt.trace.meta import trace_model
    from wrapopt.train import TrainConfig

    model = build_model("meta")
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    graph = trace_model(model, (ids,), loss_fn=lambda out, inputs: out.logits.float().pow(2).mean())
    mesh = MeshSpec(world_size=world_size, ranks_per_node=world_size, shard_size=world_size)
    fabric, compute = analytical_fabric(world_size=world_size), analytical_compute()
    if memory is None:
        probe_job = prepare(ParallelRequest(mesh=mesh, memory_budget="none"), model, graph=graph, fabric=fabric,
                            compute=compute)
        baselines = plan_model(probe_job, search=SearchOptions(trials=0))[1].baselines  # the baselines: no study
        peaks = [s.estimate.peak_bytes for s in baselines.values()]
        budget = (min(peaks) + max(peaks)) / 2
    else:
        budget = float(parse_bytes(memory))
    # compile: on by default for the stated H100; eager where this plan will run on CPU ranks (inductor's CPU
    # compile costs 30 s and more cold): See [Note: knob defaults] in wrapopt/search/knobs.py
    step = TrainConfig(compile=None if torch.cuda.is_available() else False)
    job = prepare(ParallelRequest(mesh=mesh, memory_budget=budget, train=step), model, graph=graph, fabric=fabric,
                  compute=compute)
    plan, _ = plan_model(job)
    plan.save(path)
    print(f"wrote {path}: {len(plan.units)} units ({plan.spec.label}) for {world_size} ranks, "
          f"budget {fmt_bytes(budget)} per rank")


def train(plan_path: str, steps: int, lr: float) -> int:
    rank, world = init_from_env()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    plan = WrapPlan.load(plan_path)
    model = build_model(device)
    plan.apply(model)  # fingerprint check first, then fully_shard bottom-up as the plan says
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    dp_rank, dp_size = dp_rank_size(plan.mesh)  # a 2-D plan's tensor-parallel peers share one batch
    for step in range(steps):
        ids = batch_for(step, dp_rank, dp_size, device)
        with plan.loss_context():  # loss parallel (a 2-D plan's tp.loss_parallel): logits split over the vocabulary
            loss = model(input_ids=ids, labels=ids).loss  # Hugging Face shifts the labels itself
            loss.backward()
        if isinstance(loss, DTensor):  # loss parallel's loss is a replicated DTensor
            loss = loss.full_tensor()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1}/{steps} loss {float(mean) / world:.5f}", flush=True)
    if rank == 0:
        print("done", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help="train with this plan file (under torchrun)")
    parser.add_argument("--write-plan", metavar="PATH", help="search a plan for the model and write it (no torchrun)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks the written plan is for")
    parser.add_argument("--memory", default=None, help="per-rank budget for --write-plan, e.g. 5MiB")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    if args.write_plan:
        write_plan(args.write_plan, args.world_size, args.memory)
        return 0
    if not args.plan:
        parser.error("give --plan PATH (train) or --write-plan PATH (make one)")
    return train(args.plan, args.steps, args.lr)


if __name__ == "__main__":
    run_rank_main(main)  # main(), then shutdown(): barrier, destroy the group; a WrapoptError is one line per rank
