"""Ownership follows use: a module whose parameters another module's forward reads
shares that module's unit ([Note: parameter users] in ``wrapopt/units.py``).

The tracer records who reads which parameters; ``validate_plan``, ``apply_plan``
and every search strategy (baselines, DP, uniform groupings, the Optuna space)
honour it. Models: ``nn.MultiheadAttention`` (its ``out_proj`` never runs),
``nn.TransformerEncoder``/``Decoder`` stacks, a head reading a sibling
embedding's weight, the root's own forward reading a child's weight, and a
chain whose blocks read the previous block's weight. The shared 2-rank gloo spawn
applies searched and sampled plans and trains them against the unsharded model.
"""

from __future__ import annotations

import copy
import functools
import math
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from wrapopt.cost import Simulator
from wrapopt.cost.calls import gradient_sites
from wrapopt.errors import PlanError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from tests.ranks import train, two_rank_case
from wrapopt.plan.apply import apply_plan, known_param_users
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import baselines
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.search.study.space import SearchSpace
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec
from wrapopt.trace.meta import trace_model
from wrapopt.units import together_groups, user_conflicts, validate_plan

DIM = 16


class MHAModel(nn.Module):
    """The issue's model: an attention and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0])


class EncDec(nn.Module):
    """``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` stacks and a head."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        enc = nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, dropout=0.0, batch_first=True)
        dec = nn.TransformerDecoderLayer(DIM, 2, 2 * DIM, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers, enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(dec, layers)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(tgt, self.encoder(src)))


class TiedHead(nn.Module):
    """Projects onto the vocabulary with a weight its caller passes in."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(h), weight)


class SiblingReader(nn.Module):
    """The head reads the embedding's weight (a sibling branch) through ``F.linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.head = TiedHead()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)), self.embed.weight)


class RootReader(nn.Module):
    """The root's own forward reads the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, DIM)
        self.body = nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.body(self.embed(ids)), self.embed.weight)


class ReadsPrevious(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
        out = torch.relu(self.fc(h))
        return out if prev is None else out + F.linear(h, prev)


class PrevChain(nn.Module):
    """Block 2 reads block 1's weight: blocks 1 and 2 must share a unit."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ReadsPrevious() for _ in range(n))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i, blk in enumerate(self.blocks):
            h = blk(h, self.blocks[1].fc.weight if i == 2 else None)
        return h


def _inputs(name: str, batch: int = 2):
    g = torch.Generator().manual_seed(1)
    if name in ("sibling", "root"):
        return (torch.randint(0, 32, (batch, 6), generator=g),)
    if name == "encdec":
        return (torch.randn(batch, 6, DIM, generator=g), torch.randn(batch, 5, DIM, generator=g))
    if name == "prev":
        return (torch.randn(batch, DIM, generator=g),)
    return (torch.randn(batch, 6, DIM, generator=g),)


_MODELS = {"mha": MHAModel, "encdec": EncDec, "sibling": SiblingReader, "root": RootReader, "prev": PrevChain}


def _loss(out, _inputs) -> torch.Tensor:
    return out.float().pow(2).mean()


@functools.lru_cache(maxsize=None)
def _graph(name: str):
    torch.manual_seed(0)
    return trace_model(_MODELS[name](), _inputs(name), loss_fn=_loss, fx=False)


def _mesh(world: int = 4) -> MeshSpec:
    return MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)


def _plan(*units: tuple[str, ...]) -> PlanSpec:
    return PlanSpec(tuple(UnitSpec(u) for u in units) + (UnitSpec((ROOT,), False),), _mesh())


# -- the tracer ----------------------------------------------------------------------------


def test_mha_out_proj_is_attributed_to_the_attention():
    g = _graph("mha")
    assert g.param_users == (("attn.out_proj", "attn"),)
    assert "attn.out_proj" in g.never_called


def test_transformer_layers_attribute_every_out_proj():
    g = _graph("encdec")
    want = set()
    for i in range(3):
        want.add((f"encoder.layers.{i}.self_attn.out_proj", f"encoder.layers.{i}.self_attn"))
        want.add((f"decoder.layers.{i}.self_attn.out_proj", f"decoder.layers.{i}.self_attn"))
        want.add((f"decoder.layers.{i}.multihead_attn.out_proj", f"decoder.layers.{i}.multihead_attn"))
    assert set(g.param_users) == want
    assert len(g.block_chains) == 2  # the encoder's and the decoder's layers


def test_sibling_root_and_cross_block_readers():
    assert _graph("sibling").param_users == (("embed", "head"),)
    assert _graph("root").param_users == (("embed", ROOT),)
    assert _graph("prev").param_users == (("blocks.1.fc", "blocks.2"),)


def test_tied_and_own_reads_are_not_recorded():
    """A module reading its own parameters, or a tied one under its own name, is no pair."""
    from wrapopt.models import zoo

    e = zoo.get_entry("gpt-tiny")  # wte and lm_head share one weight
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss, fx=False)
    assert g.tied_groups and g.param_users == ()


# -- validate_plan and apply ---------------------------------------------------------------


def test_out_proj_unit_is_refused_naming_both():
    g = _graph("mha")
    with pytest.raises(PlanError) as err:
        validate_plan(g, _plan(("attn.out_proj",)))
    msg = str(err.value)
    assert "'attn.out_proj'" in msg and "'attn'" in msg and "never runs" in msg
    assert "Put 'attn.out_proj' in the same unit as 'attn'" in msg and "drop the unit 'attn.out_proj'" in msg
    validate_plan(g, _plan(("attn",), ("head",)))  # the attention with its out_proj: legal


def test_sibling_and_root_readers_are_refused():
    g = _graph("sibling")
    for units in ((("head",),), (("embed",),), (("embed",), ("head",))):
        with pytest.raises(PlanError, match=r"'embed'.*'head'.*fully_shard\(\['embed', 'head'\]\)"):
            validate_plan(g, _plan(*units))
    validate_plan(g, _plan(("embed", "head")))
    validate_plan(g, _plan(("body",)))
    with pytest.raises(PlanError, match="root module's own forward reads"):
        validate_plan(_graph("root"), _plan(("embed",)))


def test_apply_refuses_before_any_fully_shard():
    """No process group is needed: the check runs before the mesh is built."""
    from torch.distributed.fsdp import FSDPModule

    model = MHAModel()
    assert known_param_users(model) == (("attn.out_proj", "attn"),)
    with pytest.raises(PlanError, match="'attn.out_proj'.*'attn'"):
        apply_plan(model, _plan(("attn.out_proj",)))  # a hand-written plan, no trace
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    # A pair only the trace knows travels in the plan file.
    g = _graph("sibling")
    est = Simulator(g, analytical_fabric(world_size=4), analytical_compute()).simulate(_plan(("embed", "head")))
    wplan = WrapPlan.from_search(_plan(("embed", "head")), SiblingReader(), est, fabric={}, baselines={},
                                 param_users=g.param_users)
    data = wplan.to_json()
    assert data["model"]["param_users"] == [["embed", "head"]]
    data["units"] = [{"modules": ["head"], "reshard_after_forward": True, "checkpoint": False}] + data["units"][-1:]
    edited = WrapPlan.from_json(data)
    with pytest.raises(PlanError, match="'embed'.*'head'"):
        edited.apply(SiblingReader())
    data["model"]["param_users"] = [["embed"]]
    with pytest.raises(PlanError, match=r"model.param_users\[0\].*at least 2"):
        WrapPlan.from_json(data)


# -- the search never proposes an illegal unit ---------------------------------------------


class _RandomSource:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def cat(self, name: str, choices: tuple):
        return self.rng.choice(choices)


def _midway(res) -> float:
    """A budget halfway between the smallest peak found and the root-only plan's."""
    low = min(s.estimate.peak_bytes for s in res.candidates)
    return (low + res.baselines["root-only"].estimate.peak_bytes) / 2


def _assert_legal(g, plan: PlanSpec) -> None:
    assert not user_conflicts(g.param_users, plan.units), plan
    validate_plan(g, plan)


@pytest.mark.parametrize("name", list(_MODELS))
def test_every_candidate_is_legal(name):
    g = _graph(name)
    mesh = _mesh()
    space = SearchSpace(g, mesh)
    alone = {m for m, _user in g.param_users}
    assert not alone & set(space.outer)
    for k, chain in enumerate(space.chains):
        for rel in space.inner[k]:
            assert not {f"{b}.{rel}" for b in chain} & alone
    rng = random.Random(0)
    for _ in range(300):  # the whole space, sampled
        _assert_legal(g, space.decode(_RandomSource(rng)))
    for plan in baselines(g, mesh).values():
        _assert_legal(g, plan)
    sim = Simulator(g, analytical_fabric(world_size=4), analytical_compute())
    res = search_plan(g, sim, mesh, options=SearchOptions(trials=30, seed=0))
    for s in res.candidates:  # baselines, DP answers, uniform groupings, the study's trials
        _assert_legal(g, s.plan)
    res = search_plan(g, sim, mesh, memory_budget=_midway(res), options=SearchOptions(trials=30, seed=0))
    for s in res.candidates:
        _assert_legal(g, s.plan)


def test_encdec_baselines_keep_out_proj_with_its_attention():
    g = _graph("encdec")
    leaves = baselines(g, _mesh())["every-leaf"]
    listed = {m for u in leaves.units for m in u.modules}
    assert "encoder.layers.0.linear1" in listed and "encoder.layers.0.self_attn.out_proj" not in listed
    assert [u.modules for u in baselines(g, _mesh())["per-block"].units[:1]] == [("encoder.layers.0",)]


def test_cross_block_reader_joins_the_blocks():
    g = _graph("prev")
    space = SearchSpace(g, _mesh())
    assert 2 in space.joined[0]  # block 2 may not start a unit: it shares block 1's
    assert together_groups(g) == (("blocks.1.fc", "blocks.2"),)
    sim = Simulator(g, analytical_fabric(world_size=4), analytical_compute())
    res = search_plan(g, sim, _mesh(), options=SearchOptions(trials=0))
    assert any("illegal plan(s) proposed by" in n for n in res.notes)
    assert "per-block" in res.baselines and all(
        u.modules != ("blocks.1",) for u in res.baselines["per-block"].plan.units)


def test_sibling_space_offers_the_pair_as_one_unit():
    space = SearchSpace(_graph("sibling"), _mesh())
    assert space.tie_units == (("embed", "head"),)
    assert "embed" not in space.outer and "head" not in space.outer and "body" in space.outer


# -- the cost model ------------------------------------------------------------------------


def test_gradients_appear_at_the_user():
    g = _graph("mha")
    grad_at, _acc = gradient_sites(g)
    out_proj = g.info("attn.out_proj").own_trainable_numel
    assert out_proj > 0 and grad_at.get("attn.out_proj", 0) == 0
    assert grad_at["attn"] == g.info("attn").own_trainable_numel + out_proj
    called = {m.fqn for m in g.call_order()}
    total = sum(m.own_trainable_numel for m in g.modules)
    assert sum(n for fqn, n in grad_at.items() if fqn in called) == total  # every gradient counted once
    g2 = _graph("sibling")
    grad_at, acc_at = gradient_sites(g2)
    emb = g2.info("embed").own_trainable_numel
    assert grad_at.get("embed", 0) == 0 and grad_at["head"] == g2.info("head").own_trainable_numel + emb
    assert acc_at["embed"] == emb  # the embedding's use accumulates into the head's gradient


def test_user_unit_carries_the_parameters():
    g = _graph("mha")
    sim = Simulator(g, analytical_fabric(world_size=4), analytical_compute())
    est = sim.simulate(_plan(("attn",)))
    attn = next(u for u in est.units if u.name == "attn")
    assert attn.param_bytes == g.info("attn").total_bytes  # in_proj and out_proj together


# -- 2 gloo ranks: searched and sampled plans train like the unsharded model ----------------


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    out: dict = {}
    mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)
    for name in ("mha", "encdec"):
        torch.manual_seed(0)
        ref_model = _MODELS[name]()
        g = trace_model(ref_model, _inputs(name), loss_fn=_loss, fx=False)
        sim = Simulator(g, analytical_fabric(world_size=world), analytical_compute())
        res = search_plan(g, sim, mesh, options=SearchOptions(trials=0))
        res = search_plan(g, sim, mesh, memory_budget=_midway(res), options=SearchOptions(trials=20, seed=0))
        plans = {"searched": res.best.plan, **{k: s.plan for k, s in res.baselines.items()}}
        space, rng = SearchSpace(g, mesh), random.Random(1)
        for i in range(4):
            plans[f"sampled{i}"] = space.decode(_RandomSource(rng))
        batches = [_inputs(name, batch=2 * world) for _ in range(2)]
        batches[1] = tuple(t.roll(1, dims=0) for t in batches[1])
        ref_losses = [float(v) for v in train(copy.deepcopy(ref_model), batches[:2], _loss)]
        mine = [tuple(t.chunk(world)[rank] for t in x) for x in batches]
        for label, plan in plans.items():
            model = copy.deepcopy(ref_model)
            apply_plan(model, plan)
            t = torch.stack(train(model, mine[:2], _loss))
            dist.all_reduce(t)
            out[f"{name}/{label}"] = ([float(v) for v in t / world], ref_losses,
                                      [list(u.modules) for u in plan.units])
    # Why the rule exists: out_proj as a unit of its own, past the check, fails in forward.
    model = MHAModel()
    fully_shard(model.attn.out_proj)
    fully_shard(model)
    try:
        model(*_inputs("mha"))
        out["unchecked"] = "ran"
    except Exception as e:  # noqa: BLE001 - the error text is the result
        out["unchecked"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    return out


@two_rank_case
def param_users_case(rank: int, world: int, tmp: str, out: dict) -> None:
    out["param_users"] = _worker(rank, world)


@pytest.fixture(scope="module")
def trained(two_rank_cases):
    return two_rank_cases[0]["param_users"]


@pytest.mark.multiprocess
def test_searched_plans_train_like_unsharded(trained):
    cases = {k: v for k, v in trained.items() if "/" in k}
    assert len(cases) == 10 + 10  # searched, the baselines (per-block,ckpt too; per-block only for encdec), 4 sampled
    assert any(["attn"] in units or any("self_attn" in m for u in units for m in u)
               for _l, _r, units in cases.values())  # some plan wraps an attention
    for key, (losses, ref, _units) in cases.items():
        assert all(math.isfinite(v) for v in losses), key
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6), key


@pytest.mark.multiprocess
def test_out_proj_alone_fails_in_forward_without_the_check(trained):
    assert "mixed torch.Tensor and DTensor" in trained["unchecked"]
