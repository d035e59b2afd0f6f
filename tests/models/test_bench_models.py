"""The wider bench set (wrapopt/models/bench_models.py): each model is built as it says, and on
2 gloo ranks the plans a search scores for it (the baselines among them) run a forward and backward
under ``apply_plan`` and give the unsharded model's loss and (averaged) gradient. The multi-process case
runs in the
shared spawn (See tests/ranks.py); it runs the searched plans that cover every cut and every
per-unit choice the search scored (``covering_plans``), not all of them.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.distributed as dist

from tests.ranks import catch, two_rank_case, zoo_graph
from wrapopt.api import compute_for, resolve_fabric
from wrapopt.cost import Simulator
from wrapopt.models import zoo
from wrapopt.models.bench_models import BENCH, MoEFFN
from wrapopt.plan.apply import apply_plan
from wrapopt.search.driver import search_plan
from wrapopt.spec import MeshSpec, PlanSpec
from wrapopt.train import TrainConfig

BENCH_NAMES = [e.name for e in BENCH]
TRAINABLE = [n for n, e in zoo.ZOO.items() if e.trainable]


def _trace(name: str):
    return zoo_graph(name)  # traced once per process


# --- the models ----------------------------------------------------------------------------------------


def test_bench_set_is_registered_in_the_zoo_as_trainable():
    assert BENCH_NAMES == ["tx-encoder", "tx-tied", "tx-decoder", "wide-shallow", "deep-narrow", "big-vocab",
                           "moe-tiny", "lora-tiny", "mha-tied"]
    for name in BENCH_NAMES:
        e = zoo.get_entry(name)
        assert e.suite == "bench" and e.trainable and e.description
    assert {e.suite for n, e in zoo.ZOO.items() if n not in BENCH_NAMES} == {"zoo"}


@pytest.mark.parametrize("name,chains", [("tx-encoder", [4]), ("tx-decoder", [2, 3]), ("wide-shallow", [2]),
                                         ("deep-narrow", [20]), ("big-vocab", [2]), ("moe-tiny", [4]),
                                         ("lora-tiny", [4]), ("mha-tied", [8])])
def test_block_chains(name, chains):
    assert [len(c) for c in _trace(name).block_chains] == chains


def test_transformer_layers_record_out_proj_as_read_by_its_attention():
    users = dict(_trace("tx-encoder").param_users)
    assert users["encoder.layers.0.self_attn.out_proj"] == "encoder.layers.0.self_attn"
    users = dict(_trace("tx-decoder").param_users)
    assert (users["transformer.decoder.layers.1.multihead_attn.out_proj"]
            == "transformer.decoder.layers.1.multihead_attn")


def test_big_vocab_parameters_are_mostly_embedding_and_head():
    model = zoo.get_entry("big-vocab").build("meta")
    total = sum(p.numel() for p in model.parameters())
    assert (model.tok.weight.numel() + model.out.weight.numel()) / total > 0.95
    assert model.tok.weight is not model.out.weight


def test_lora_tiny_trains_only_the_adapters():
    model = zoo.get_entry("lora-tiny").build("meta")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_a." in n or ".lora_b." in n for n in trainable)
    assert {n.split(".")[3] for n in trainable} == {"q_proj", "v_proj"}
    assert _trace("lora-tiny").trainable_bytes == 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_moe_routing_depends_on_the_data_and_is_deterministic_under_a_seed():
    torch.manual_seed(0)
    moe = MoEFFN(16, 32, num_experts=4, top_k=2)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    chosen = moe.router(x.reshape(-1, 16)).topk(2, dim=-1).indices
    assert len(set(chosen[:, 0].tolist())) > 1  # tokens go to different experts
    torch.manual_seed(0)
    again = MoEFFN(16, 32, num_experts=4, top_k=2)
    assert torch.equal(moe(x), again(x))
    # Without capacity drops the block equals the routed sum, expert by expert.
    wide = MoEFFN(16, 32, num_experts=4, top_k=2, capacity_factor=4.0)
    wide.load_state_dict(moe.state_dict())
    t = x.reshape(-1, 16)
    w, idx = wide.router(t).softmax(-1).topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros_like(t)
    for j in range(2):
        for n in range(t.shape[0]):
            e = idx[n, j]
            ref[n] += w[n, j] * (torch.nn.functional.gelu(t[n] @ wide.w_in[e]) @ wide.w_out[e])
    assert torch.allclose(wide(x).reshape(-1, 16), ref, atol=1e-5)


def test_moe_tiny_traces_on_meta_without_a_real_run():
    graph = _trace("moe-tiny")
    assert not any("real" in s for s in graph.estimates)
    assert graph.info("blocks.0.ffn").fwd_flops > 0
    # Its experts' weights are stacked and split per expert by a batched matmul: 4 experts, seen in the trace.
    assert [(m.fqn, m.experts) for m in graph.modules if m.experts] == [(f"blocks.{i}.ffn", 4) for i in range(4)]


# --- every searched plan runs, 2 ranks -----------------------------------------------------------------


def searched_plans(name: str, world: int, graph=None) -> dict[str, PlanSpec]:
    """Every plan the search scores for ``name`` (traced, or its ``graph``) under a loose, a midway and
    a tight budget (the baselines among them), on the analytical profile the CLI uses without one,
    keyed by units."""
    graph = graph if graph is not None else _trace(name)
    mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)
    fabric = resolve_fabric(None, world_size=world, ranks_per_node=world)
    sim = Simulator(graph, fabric, compute_for(fabric, None, TrainConfig(), "float32"))
    probe = search_plan(graph, sim, mesh)
    peaks = [s.estimate.peak_bytes for s in probe.baselines.values()]
    budgets = (math.inf, (min(peaks) + max(peaks)) / 2, probe.baselines["per-block"].estimate.peak_bytes * 1.02)
    plans: dict[str, PlanSpec] = {}
    for budget in budgets:
        for s in search_plan(graph, sim, mesh, memory_budget=budget).candidates:
            plans.setdefault(repr((s.plan.units, s.plan.forward_prefetch)), s.plan)
    return plans


def _cut(plan: PlanSpec) -> tuple:
    return tuple(u.modules for u in plan.units)


def _choices(plan: PlanSpec) -> set:
    """The per-unit choices, prefetch and mesh ``plan`` runs: the code paths besides its cut."""
    return ({("prefetch", plan.forward_prefetch), ("mesh", plan.mesh)}
            | {("unit", u.reshard_after_forward, u.checkpoint, u.is_root) for u in plan.units})


def covering_plans(plans: dict[str, PlanSpec]) -> list[PlanSpec]:
    """Searched plans, in order, until every cut among ``plans`` is run by one of them, then
    those that add a per-unit choice, prefetch or mesh not run yet (a plan adding nothing new
    exercises no new code path: the 276 searched plans of the 12 models come down to 109)."""
    cuts: set = set()
    seen: set = set()
    out = []
    for plan in plans.values():
        if _cut(plan) not in cuts:
            cuts.add(_cut(plan))
            seen |= _choices(plan)
            out.append(plan)
    for plan in plans.values():
        if _choices(plan) - seen:
            seen |= _choices(plan)
            out.append(plan)
    return out


def test_the_plans_run_cover_every_cut_and_choice_searched():
    plans = searched_plans("llama-tiny", 2)
    run = covering_plans(plans)
    assert len(run) < len(plans)
    assert {_cut(p) for p in run} == {_cut(p) for p in plans.values()}
    assert set().union(*map(_choices, run)) == set().union(*map(_choices, plans.values()))
    assert {any(u.checkpoint for u in p.units) for p in run} == {True, False}


def grad_digest(model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """Per trainable parameter, (sum of its whole gradient times a fixed random tensor of its shape,
    sum of the gradient's magnitudes): equal for equal gradients, whatever the sharding.

    [Note: a digest of shards] Both sums are sums over the gradient's elements, so each rank sums its
    own shard against its slice of the fixed tensor (the slice at the shard's global offset; a mesh
    dimension the gradient is replicated on counts once, at its coordinate 0) and ONE all_reduce of
    every parameter's pair adds the shards up: no gradient is gathered. Collective when the model has
    sharded gradients: every rank calls it on the same model structure."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local: dict[str, tuple[float, float]] = {}
    sharded: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or p.grad is None:
            continue
        g = p.grad
        w = torch.rand(g.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())), dtype=torch.float64)
        if not isinstance(g, DTensor):
            local[name] = (float((g.double() * w).sum()), float(g.double().abs().sum()))
            continue
        if not all(isinstance(pl, (Shard, Replicate)) for pl in g.placements):
            g = g.redistribute(placements=[pl if isinstance(pl, Shard) else Replicate() for pl in g.placements])
        shape, offset = compute_local_shape_and_global_offset(g.shape, g.device_mesh, g.placements)
        counted = all(g.device_mesh.get_local_rank(d) == 0
                      for d, pl in enumerate(g.placements) if isinstance(pl, Replicate))
        part = g.to_local().double()
        piece = w[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        sharded[name] = (torch.stack([(part * piece).sum(), part.abs().sum()]) if counted and part.numel()
                         else torch.zeros(2, dtype=torch.float64))
    if sharded:
        total = torch.stack(list(sharded.values()))
        dist.all_reduce(total)
        local.update({name: (float(t[0]), float(t[1])) for name, t in zip(sharded, total)})
    return {name: local[name] for name, p in model.named_parameters() if name in local}


@two_rank_case
def searched_plans_run_case(rank: int, world: int, tmp: str, out: dict) -> None:
    """One forward and backward of every covering plan: its loss on this rank's half of the batch
    and its averaged gradient, against the unsharded model's on the same half and the mean of the
    unsharded model's gradients on the ranks' halves."""
    # Each rank traces and searches its share of the models, and the ranks swap the plans and the
    # traces' parameter users (what apply_plan needs): the searches are the same on every rank, and
    # half of them per rank halve the case's search time; each model is traced once, on one rank
    # (the traces, torch.export included, were most of this case's time).
    mine = {}
    for i, name in enumerate(TRAINABLE):
        if i % world == rank:
            graph = _trace(name)
            mine[name] = (covering_plans(searched_plans(name, world, graph)), graph.param_users)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    found = {name: got for share in every for name, got in share.items()}
    for name in TRAINABLE:
        e = zoo.get_entry(name)
        plans, param_users = found[name]
        whole = e.inputs(batch=e.batch * world)
        x = tuple(t.chunk(world)[rank] for t in whole)
        ref = e.build("cpu", seed=0)
        ref_loss = float(e.loss(ref(*x), x))
        for r in range(world):  # data parallelism's gradient: the mean of each rank's (batch norms, expert
            half = tuple(t.chunk(world)[r] for t in whole)  # capacity per rank's batch, as the ranks run them)
            (e.loss(ref(*half), half) / world).backward()
        rows = []
        for spec in plans:
            model = e.build("cpu", seed=0)
            got: dict = {}

            def run(model=model, spec=spec, got=got) -> None:
                apply_plan(model, spec, param_users=param_users)
                loss = e.loss(model(*x), x)
                loss.backward()
                got["loss"], got["grads"] = float(loss), grad_digest(model)

            rows.append({"plan": spec.label, "units": len(spec.units), "error": catch(run, Exception), **got})
        out[f"bench/{name}"] = {"ref_loss": ref_loss, "ref_grads": grad_digest(ref), "rows": rows}


@pytest.mark.multiprocess
def test_every_searched_plan_runs_and_trains_alike(two_rank_cases):
    """Each covering plan's loss is the unsharded model's on the rank's batch, and its gradient,
    averaged over the ranks, is the mean of the unsharded model's on each rank's batch (to 1e-5 of its
    magnitude)."""
    failed, checked = [], 0
    for rank_out in two_rank_cases:
        for name in TRAINABLE:
            case = rank_out[f"bench/{name}"]
            assert len(case["rows"]) >= 5, name  # the baselines at least
            want = case["ref_grads"]
            assert want, name
            for r in case["rows"]:
                checked += 1
                if r["error"] or not math.isfinite(r.get("loss", math.nan)):
                    failed.append(f"{name} {r['plan']}: {r['error'] or r.get('loss')}")
                    continue
                assert r["loss"] == pytest.approx(case["ref_loss"], rel=1e-5), (name, r["plan"])
                assert r["grads"].keys() == want.keys(), (name, r["plan"])
                for p, (d, size) in want.items():
                    assert abs(r["grads"][p][0] - d) <= 1e-5 * size + 1e-9, (name, r["plan"], p, r["grads"][p], d)
    assert not failed, f"{len(failed)} of {checked} searched plans failed to run: " + "; ".join(failed)
