"""Expert parallelism applied (plan/ep.py): EP 2 on 2 gloo ranks trains as the unsharded model does,
for the zoo's moe-tiny (capacity buffers) and a tiny Hugging Face Mixtral (dropless routing).

The reference is the unsharded model stepping on the mean of the ranks' losses, each rank's
batch routed on its own (as data parallelism routes it: moe-tiny's capacity is per batch), fp32,
3 steps of AdamW; the EP model's losses, averaged over the ranks, match within 1e-5 relative."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from tests.ranks import MESH2, STEPS, catch, four_rank_case, mean_over_ranks, two_rank_case
from wrapopt.errors import PlanError
from wrapopt.models import zoo
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec

pytestmark = pytest.mark.multiprocess

EP2 = replace(MESH2, ep_size=2)


def _reference(model, per_rank, loss_fn, world):
    """The unsharded model on every rank's batch, one AdamW step on the mean loss, per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in per_rank:
        loss = sum(loss_fn(model(*x) if not isinstance(x, dict) else model(**x), x) for x in step) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _train(model, mine, loss_fn, world):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in mine:
        loss = loss_fn(model(*x) if not isinstance(x, dict) else model(**x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return mean_over_ranks(losses, world)


def _hf_mixtral(seed: int = 0):
    from tests.models.hf_configs import archs

    make, _cls = archs()["mixtral"]
    cfg = make()
    cfg._experts_implementation = "eager"  # the CPU grouped matmul has no float32 backward
    import transformers

    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(cfg)


def _hf_loss(out, _x):
    return out.loss


@two_rank_case
def ep_parity_cases(rank: int, world: int, tmp: str, out: dict) -> None:
    from wrapopt.plan.apply import apply_plan

    # moe-tiny: a unit per block (its experts module, ffn, becomes a unit of its own over efsdp)
    e = zoo.get_entry("moe-tiny")
    ref = e.build("cpu", seed=0)
    blocks = [f"blocks.{i}" for i in range(len(ref.blocks))]
    spec = PlanSpec(tuple(UnitSpec((b,)) for b in blocks) + (UnitSpec((ROOT,), False),), EP2, label="blocks + ep2")
    full = e.inputs(batch=2 * world)  # each rank's 2 sequences, rolled per step
    steps = [[tuple(t.roll(s, dims=0).chunk(world)[r] for t in full) for r in range(world)] for s in range(STEPS)]
    want = _reference(copy.deepcopy(ref), steps, e.loss, world)
    model = apply_plan(copy.deepcopy(ref), spec)
    got = _train(model, [s[rank] for s in steps], e.loss, world)
    local = tuple(model.blocks[0].ffn.w_in.to_local().shape) if hasattr(model.blocks[0].ffn.w_in, "to_local") else None
    out["ep/moe-tiny"] = {"losses": got, "ref": want, "local": local}
    ckpt = PlanSpec(tuple(UnitSpec((b,), True, True) for b in blocks) + (UnitSpec((ROOT,), False),), EP2, label="c")
    model = apply_plan(copy.deepcopy(ref), ckpt)  # checkpointed blocks: the all-to-alls run again in backward
    out["ep/moe-tiny-ckpt"] = {"losses": _train(model, [s[rank] for s in steps], e.loss, world), "ref": want}
    # Hugging Face Mixtral (4 experts, top-2): blocks as units, the experts module inside them
    hf = _hf_mixtral()
    blocks = [f"model.layers.{i}" for i in range(hf.config.num_hidden_layers)]
    spec = PlanSpec(tuple(UnitSpec((b,)) for b in blocks) + (UnitSpec((ROOT,), False),), EP2, label="blocks + ep2")
    gen = torch.Generator().manual_seed(1)
    steps = [[{"input_ids": (ids := torch.randint(3, 128, (2, 16), generator=gen)), "labels": ids}
              for _r in range(world)] for _s in range(STEPS)]
    want = _reference(copy.deepcopy(hf), steps, _hf_loss, world)
    model = apply_plan(copy.deepcopy(hf), spec)
    got = _train(model, [s[rank] for s in steps], _hf_loss, world)
    out["ep/mixtral"] = {"losses": got, "ref": want, "experts": model.model.layers[0].mlp.experts.num_experts}
    # bad input: a degree that does not divide the experts (moe-tiny has 4: a plan for 3 is refused)
    odd = copy.deepcopy(hf)
    for layer in odd.model.layers:  # 3 experts per mixture: ep 2 does not divide them
        ex = layer.mlp.experts
        ex.num_experts = 3
        ex.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.detach()[:3].clone())
        ex.down_proj = torch.nn.Parameter(ex.down_proj.detach()[:3].clone())
    out["ep/odd"] = catch(lambda: apply_plan(odd, spec), PlanError)


def test_ep2_trains_as_the_unsharded_model(two_rank_cases):
    for key in ("ep/moe-tiny", "ep/moe-tiny-ckpt", "ep/mixtral"):
        r = two_rank_cases[0][key]
        assert r["losses"] == pytest.approx(r["ref"], rel=1e-5), key
        assert r["ref"][0] != r["ref"][-1], key  # it trained
    assert two_rank_cases[0]["ep/mixtral"]["experts"] == 2  # each rank runs 2 of the 4 experts
    assert two_rank_cases[0]["ep/moe-tiny"]["local"] == (2, 64, 128)  # and holds their weights only


def test_ep_degree_that_does_not_divide_the_experts_is_named(two_rank_cases):
    for r in two_rank_cases:
        msg = r["ep/odd"]
        assert msg and "does not divide the 3 experts" in msg and "model.layers.0.mlp.experts" in msg
        assert "degrees that do: 3" in msg


@four_rank_case
def ep_hsdp(rank: int, world: int, out: dict) -> None:
    """Expert parallelism under HSDP on 4 ranks: replicate 2 x shard 2, ep 2 inside each shard group
    (the experts HSDP over (replicate, efsdp 1)), moe-tiny with a unit per block, 3 AdamW steps
    against the unsharded model on the mean of the ranks' losses."""
    from wrapopt.plan.apply import apply_plan

    e = zoo.get_entry("moe-tiny")
    ref = e.build("cpu", seed=0)
    blocks = [f"blocks.{i}" for i in range(len(ref.blocks))]
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, ep_size=2)
    spec = PlanSpec(tuple(UnitSpec((b,)) for b in blocks) + (UnitSpec((ROOT,), False),), mesh, label="hsdp + ep2")
    full = e.inputs(batch=2 * world)
    steps = [[tuple(t.roll(s, dims=0).chunk(world)[r] for t in full) for r in range(world)] for s in range(STEPS)]
    want = _reference(copy.deepcopy(ref), steps, e.loss, world)
    model = apply_plan(copy.deepcopy(ref), spec)
    out["losses"] = _train(model, [s[rank] for s in steps], e.loss, world)
    out["ref"] = want
    w = model.blocks[0].ffn.w_in
    out["experts_mesh"] = (w.device_mesh.mesh_dim_names, tuple(w.device_mesh.shape), tuple(w.to_local().shape))


def test_ep2_under_hsdp_trains_as_the_unsharded_model(four_rank_cases):
    r = four_rank_cases[0][__name__]
    assert r["losses"] == pytest.approx(r["ref"], rel=1e-5)
    assert r["ref"][0] != r["ref"][-1]  # it trained
    names, shape, local = r["experts_mesh"]
    assert names == ("replicate", "efsdp") and shape == (2, 1)  # HSDP over replicate, ep 2 of the shard group's 2
    assert local == (2, 64, 128)  # each rank holds its 2 of the 4 experts
