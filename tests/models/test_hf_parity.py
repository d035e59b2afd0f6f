"""Hugging Face models from tiny configs train alike sharded and unsharded: 3 steps on
2 gloo ranks with the plan ``search_plan`` chose under a budget that needs several units
(and the per-block baseline), against
the unsharded model on the whole batch, fp32, dropout off (eval mode), within 1e-5.

One case in the shared spawn of 2 ranks runs every model (See tests/ranks.py). The
loss is the model's own (labels among the inputs), a mean over equally many tokens
per rank, so the mean of the ranks' losses is the whole batch's.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.ranks import MESH2, STEPS, TOL, mean_over_ranks, two_rank_case

transformers = pytest.importorskip("transformers")

PARITY = ("llama", "gpt2", "bert", "t5", "mixtral")


def _train(model, steps) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in steps:
        loss = model(*x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _steps(inputs: tuple, world: int, rank: int):
    """Distinct data per step (the batch rolled); each rank's half of every tensor."""
    full = [tuple(t.roll(s, dims=0) if isinstance(t, torch.Tensor) else t for t in inputs) for s in range(STEPS)]
    mine = [tuple(t.chunk(world)[rank] if isinstance(t, torch.Tensor) else t for t in x) for x in full]
    return full, mine


@two_rank_case
def hf_parity(rank: int, world: int, tmp: str, out: dict) -> None:
    from tests.models.hf_configs import write_config
    from wrapopt.cost.simulate import Simulator
    from wrapopt.hardware import analytical_compute, analytical_fabric
    from wrapopt.models.sources import resolve_model
    from wrapopt.plan.apply import apply_plan
    from wrapopt.search.driver import SearchOptions, search_plan
    from wrapopt.trace.meta import trace_model

    directory = os.path.join(tmp, f"hf-rank{rank}")
    os.makedirs(directory, exist_ok=True)
    paths = {name: write_config(name, directory) for name in PARITY}
    # Each rank searches its share of the models and the ranks swap plans: a search is the same on
    # every rank (seeded), so half of them per rank halve the case's search time.
    mine_plans = {}
    for name in PARITY[rank::world]:
        per_rank = resolve_model(f"hf:{paths[name]}", batch=2, seq=8)
        graph = trace_model(per_rank.build("meta"), per_rank.inputs)
        sim = Simulator(graph, analytical_fabric(world_size=world), analytical_compute())
        # Tiny models fit whole, where the answer is one unit; a budget below every one-unit
        # plan's peak makes the search cut the model.
        whole = min(s.estimate.peak_bytes for s in search_plan(graph, sim, MESH2).candidates if len(s.plan.units) == 1)
        result = search_plan(graph, sim, MESH2, memory_budget=whole - 1, options=SearchOptions(trials=10, seed=0))
        mine_plans[name] = (("searched", result.best.plan), ("per-block", result.baselines["per-block"].plan))
    every: list = [None] * world
    dist.all_gather_object(every, mine_plans)
    plans = {name: found for share in every for name, found in share.items()}
    for name in PARITY:
        src = resolve_model(f"hf:{paths[name]}", batch=2 * world, seq=8)
        full, mine = _steps(src.inputs, world, rank)
        ref = src.build("cpu").eval()
        ref_losses = [float(v) for v in _train(ref, full)]
        for label, plan in plans[name]:
            model = apply_plan(src.build("cpu").eval(), plan)
            out[f"hf/{name}/{label}"] = {
                "losses": mean_over_ranks(_train(model, mine), world), "ref": ref_losses,
                "plan": f"{plan.label}: {len(plan.units)} units, shard {plan.mesh.shard_size}",
                "units": len(plan.units)}

@pytest.mark.multiprocess
def test_hf_models_train_alike_sharded_with_the_searched_plan(two_rank_cases):
    r = two_rank_cases[0]
    for name in PARITY:
        for label in ("searched", "per-block"):
            case = r[f"hf/{name}/{label}"]
            assert case["losses"] == pytest.approx(case["ref"], abs=TOL), (name, label, case["plan"])
            assert case["ref"][0] != case["ref"][-1]  # it trained: the loss moved
        assert r[f"hf/{name}/searched"]["units"] > 1, r[f"hf/{name}/searched"]["plan"]
    assert r["hf/llama/searched"]["losses"] == two_rank_cases[1]["hf/llama/searched"]["losses"]
