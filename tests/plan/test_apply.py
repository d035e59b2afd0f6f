"""Multi-process: sharded models built from plans train like the unsharded model.

One spawn of 2 gloo ranks runs every case (each spawn costs seconds). Each
rank trains on its half of a global batch; the reference trains the whole
batch unsharded. With a mean loss the averaged gradients are equal, so the
losses must match step for step (fp32, no dropout).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.ranks import train
from wrapopt.launch import spawn

pytestmark = pytest.mark.multiprocess

TOL = 1e-5


def _plans(g, world):
    from wrapopt.search.baselines import baselines
    from wrapopt.spec import MeshSpec, PlanSpec, UnitSpec

    mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)
    b = baselines(g, mesh)
    plans = dict(b)
    blocks = g.blocks
    root = b["root-only"].units[-1]
    plans["groups-of-2"] = PlanSpec(tuple(UnitSpec(blocks[i:i + 2]) for i in range(0, len(blocks), 2)) + (root,), mesh,
                                    label="g2")
    plans["keep+ckpt"] = PlanSpec(tuple(UnitSpec((blk,), False, True) for blk in blocks) + (root,), mesh, label="kc")
    plans["prefetch"] = PlanSpec(b["per-block"].units, mesh, forward_prefetch=1, label="pf")
    return plans


def _parity_worker(rank: int, world: int) -> dict:
    from wrapopt.models import zoo
    from wrapopt.plan.apply import apply_plan
    from wrapopt.trace.meta import trace_model

    out: dict = {}
    for name in ("gpt-tiny", "t5-tiny"):
        e = zoo.get_entry(name)
        ref_model = e.build("cpu", seed=0)
        g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
        full = [e.inputs(batch=2 * world) for _ in range(3)]
        for step, x in enumerate(full):  # distinct data per step
            full[step] = tuple(t.roll(step, dims=0) for t in x)
        mine = [tuple(t.chunk(world)[rank] for t in x) for x in full]
        ref = copy.deepcopy(ref_model)
        ref_losses = [float(v) for v in train(ref, full[:3], e.loss)]
        for label, plan in _plans(g, world).items():
            if name == "t5-tiny" and label not in ("per-block", "groups-of-2", "no-shard"):
                continue
            model = copy.deepcopy(ref_model)
            apply_plan(model, plan)
            losses = train(model, mine[:3], e.loss)
            t = torch.stack(losses)
            dist.all_reduce(t)  # mean over ranks of half-batch losses = full-batch loss
            out[f"{name}/{label}"] = ([float(v) for v in t / world], ref_losses)
    return out


def _errors_worker(rank: int, world: int) -> dict:
    from wrapopt.errors import PlanError
    from wrapopt.models import zoo
    from wrapopt.plan.apply import apply_plan
    from wrapopt.search.baselines import baselines
    from wrapopt.spec import MeshSpec, PlanSpec, UnitSpec
    from wrapopt.trace.meta import trace_model

    e = zoo.get_entry("gpt-tiny")
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
    out = {}
    wrong = baselines(g, MeshSpec(world_size=4, ranks_per_node=4, shard_size=4))["per-block"]
    try:
        apply_plan(e.build("cpu"), wrong)
    except PlanError as err:
        out["world"] = str(err)
    missing = PlanSpec((UnitSpec(("layers.9",)), UnitSpec(("",), False)),
                       MeshSpec(world_size=world, ranks_per_node=world, shard_size=world))
    try:
        apply_plan(e.build("cpu"), missing)
    except PlanError as err:
        out["missing"] = str(err)
    ok = baselines(g, MeshSpec(world_size=world, ranks_per_node=world, shard_size=world))["per-block"]
    m = apply_plan(e.build("cpu"), ok)
    try:
        apply_plan(m, ok)
    except PlanError as err:
        out["twice"] = str(err)
    dist.barrier()  # every rank got here: no rank hung on a bad plan
    return out


@pytest.fixture(scope="module")
def parity():
    return spawn(_parity_worker, world_size=2, timeout_s=300)[0]


def test_sharded_training_matches_unsharded(parity):
    assert len(parity) >= 10
    for case, (got, want) in parity.items():
        assert got == pytest.approx(want, abs=TOL), case
        assert want[0] != want[-1]  # it trained: the loss moved


def test_tied_embeddings_stay_tied(parity):
    # gpt-tiny and t5-tiny tie input and output embeddings; every plan kept them in one unit
    # (else fully_shard fails or the losses above would diverge).
    assert any(k.startswith("gpt-tiny/") for k in parity) and any(k.startswith("t5-tiny/") for k in parity)


def test_bad_plans_fail_on_every_rank_before_collectives():
    results = spawn(_errors_worker, world_size=2, timeout_s=120)
    for r in results:
        assert "4 ranks" in r["world"] and "2" in r["world"]
        assert "layers.9" in r["missing"]
        assert "already sharded" in r["twice"]
