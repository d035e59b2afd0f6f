"""Long sequences: a Hugging Face Llama trained with a context-parallel wrapopt plan; no download.

Each sequence is split over the plan's ``cp`` ranks (``plan.mesh.cp_size``): the loop runs every
forward and backward inside ``plan.train_context``, which shards the input ids, the labels and
the position ids on their sequence dim (torch's ``context_parallel``, ring attention). Search a
plan offline, then train:

    python examples/train_long_context.py --write-plan plan_cp.json --cp 2
    torchrun --nproc_per_node 2 examples/train_long_context.py --plan plan_cp.json

What the loop must do under context parallelism (See [Note: applying context parallelism] in
wrapopt/plan/cp.py): shift the labels before the cut (each rank sees 2 chunks of its sequence,
not a contiguous run), pass the positions in (``position_ids``), load the model with SDPA
attention, and make the sequence a multiple of 2 x cp. Needs ``pip install transformers``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from wrapopt import WrapPlan
from wrapopt.launch import init_from_env, run_rank_main

VOCAB, SEQ, BATCH = 256, 64, 2  # sequences per data-parallel rank


def build_model(device: str | torch.device = "cpu", seed: int = 0):
    """A 4-layer Llama, hidden size 64, SDPA attention: the same weights for the same seed."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def write_plan(path: str, world_size: int, cp: int | str) -> None:
    """Trace on meta, search on the analytical fabric at context-parallel degree ``cp``, save."""
    from wrapopt.api import ParallelRequest, plan_model, prepare
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric
    from wrapopt.spec import MeshSpec
    from wrapopt.trace.meta import trace_model

    model = build_model("meta")
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    graph = trace_model(model, (ids,), loss_fn=lambda out, inputs: out.logits.float().pow(2).mean())
    mesh = MeshSpec(world_size=world_size, ranks_per_node=world_size, shard_size=world_size)
    job = prepare(ParallelRequest(mesh=mesh, cp=cp, memory_budget="none"), model, graph=graph,
                  fabric=analytical_fabric(world_size=world_size), compute=analytical_compute())
    plan, _ = plan_model(job)
    plan.save(path)
    print(f"wrote {path}: {len(plan.units)} units, cp {plan.mesh.cp_size}, for {world_size} ranks")


def batch_for(step: int, batch_rank: int, batch_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sequences and their labels, shifted by one before any cut."""
    g = torch.Generator().manual_seed(1000 + step)
    toks = torch.randint(0, VOCAB, (BATCH * batch_ranks, SEQ + 1), generator=g).chunk(batch_ranks)[batch_rank]
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def train(plan_path: str, steps: int, lr: float) -> int:
    rank, world = init_from_env()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    plan = WrapPlan.load(plan_path)
    model = plan.apply(build_model(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # The ranks of one cp group read the same sequences: the batch is split over the others.
    cp = plan.mesh.cp_size
    batch_ranks, batch_rank = world // cp, rank // cp if plan.mesh.tp_size == 1 else None
    if batch_rank is None:
        raise SystemExit("this example splits the batch for plans without tensor parallelism")
    for step in range(steps):
        ids, labels = (t.to(device) for t in batch_for(step, batch_rank, batch_ranks))
        positions = torch.arange(SEQ, device=device).expand_as(ids).clone()
        with plan.train_context(model, buffers=[ids, labels, positions], seq_dims=[1, 1, 1],
                                no_restore=[ids, labels, positions]):
            logits = model(input_ids=ids, position_ids=positions).logits  # this rank's 2 x SEQ / (2 cp) tokens
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank holds as many tokens: the mean of the means is the batch's
        if rank == 0:
            print(f"step {step + 1}/{steps} loss {float(mean) / world:.5f} ({ids.shape[1]} of {SEQ} tokens "
                  "per sequence on this rank)", flush=True)
    if rank == 0:
        print("done", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help="train with this plan file (under torchrun)")
    parser.add_argument("--write-plan", metavar="PATH", help="search a plan for the model and write it (no torchrun)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks the written plan is for")
    parser.add_argument("--cp", default="2", help="context-parallel degree of the written plan, or auto")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    if args.write_plan:
        write_plan(args.write_plan, args.world_size, args.cp if args.cp == "auto" else int(args.cp))
        return 0
    if not args.plan:
        parser.error("give --plan PATH (train) or --write-plan PATH (make one)")
    return train(args.plan, args.steps, args.lr)


if __name__ == "__main__":
    run_rank_main(main)  # main(), then shutdown(): barrier, destroy the group; a WrapoptError is one line per rank
