"""Distributed checkpoints across plans: a model trained under one plan, saved with
``torch.distributed.checkpoint`` (DCP), loads into the same model sharded under another
plan (blocks in pairs, no sharding, or a 2-D plan: tensor parallel 2 with blocks in pairs)
and trains on exactly as if never stopped. DCP
stores each tensor by its fully qualified name and global shape, not by how FSDP2 cut
it, so the plan is free to change between save and load (README, "Checkpoints across
plans"). The case runs in the shared spawn (See tests/ranks.py).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from tests.ranks import TOL, mean_over_ranks, plan_specs, tp_plan_specs, two_rank_case, zoo_graph
from wrapopt.fingerprint import model_fingerprint
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec

pytestmark = pytest.mark.multiprocess

NAME, STEPS, SAVED_AT = "gpt-tiny", 4, 2  # train 2 steps, save, load under another plan, train 2 more


# 1-D to 2-D: the same 2 ranks as one tensor-parallel group (tp 2, FSDP over 1 rank): both see the whole batch.
MESH_TP = MeshSpec(world_size=2, ranks_per_node=2, shard_size=1, tp_size=2)


def _mine(world: int, rank: int, *, whole: bool = False) -> list[tuple]:
    e = zoo.get_entry(NAME)
    full = [tuple(t.roll(s, dims=0) for t in e.inputs(batch=2 * world)) for s in range(STEPS)]
    return full if whole else [tuple(t.chunk(world)[rank] for t in x) for x in full]


def _steps(model, opt, batches) -> list[torch.Tensor]:
    losses = []
    for x in batches:
        loss = zoo.get_entry(NAME).loss(model(*x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


@two_rank_case
def dcp_across_plans(rank: int, world: int, tmp: str, out: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)
    graph = zoo_graph(NAME)
    specs = {**plan_specs(graph, mesh), "no-shard": baselines(graph, mesh)["no-shard"],
             "tp2": tp_plan_specs(graph, MESH_TP)["groups-of-2"]}
    ref = zoo.get_entry(NAME).build("cpu", seed=0)
    fingerprint = model_fingerprint(ref)
    sharded = lambda label: WrapPlan(spec=specs[label], model=fingerprint).apply(copy.deepcopy(ref))  # noqa: E731
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731
    mine = _mine(world, rank)
    model = sharded("per-block")
    straight = mean_over_ranks(_steps(model, adamw(model), mine), world)  # never stopped
    model = sharded("per-block")
    opt = adamw(model)
    before = mean_over_ranks(_steps(model, opt, mine[:SAVED_AT]), world)
    msd, osd = get_state_dict(model, opt)
    path = os.path.join(tmp, "dcp-per-block")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    dist.barrier()
    for label, with_optim in (("groups-of-2", True), ("no-shard", True), ("tp2", True), ("groups-of-2", False)):
        other = sharded(label)  # fresh weights: everything it trains on comes from the checkpoint
        other_opt = adamw(other)
        msd, osd = get_state_dict(other, other_opt)
        state = {"model": msd, "optim": osd} if with_optim else {"model": msd}
        dcp.load(state, checkpoint_id=path)
        if with_optim:
            set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_model_state_dict(other, state["model"])
        data = _mine(world, rank, whole=True) if label == "tp2" else mine  # the tp group shares one batch
        after = mean_over_ranks(_steps(other, other_opt, data[SAVED_AT:]), world)
        out[f"dcp/{label}" + ("" if with_optim else "/model-only")] = {"straight": straight, "resumed": before + after}
        if label == "tp2":  # the q projection of a block: a 2-D DTensor, split by tensor parallelism
            q = dict(other.named_parameters())["layers.0.attn.q_proj.weight"]
            out["dcp/tp2/mesh"] = list(q.device_mesh.mesh_dim_names or ())


def test_a_checkpoint_saved_under_one_plan_trains_on_under_another(two_rank_cases):
    for label in ("groups-of-2", "no-shard", "tp2"):
        for r in two_rank_cases:
            got = r[f"dcp/{label}"]
            assert got["resumed"] == pytest.approx(got["straight"], abs=TOL), label
            assert got["resumed"][SAVED_AT:] != got["straight"][:SAVED_AT]  # training went on: the loss moved
    assert all("tp" in r["dcp/tp2/mesh"] for r in two_rank_cases)
    for r in two_rank_cases:  # the test sees the optimizer state: without it, AdamW's next steps differ
        got = r["dcp/groups-of-2/model-only"]
        assert got["resumed"][:SAVED_AT + 1] == pytest.approx(got["straight"][:SAVED_AT + 1], abs=TOL)
        assert abs(got["resumed"][-1] - got["straight"][-1]) > 100 * TOL
