"""Context parallelism applied (plan/cp.py): parity with the unsharded model on 2 gloo ranks (cp 2),
the tokens each rank holds under the head-tail balancer, and the ring's collectives against
``ring_exchanges`` (what cost/cp.py prices), counted by torch's CommDebugMode.

[Note: what the CP parity compares] The zoo's gpt-tiny with its positions passed in (``GPTPos``:
the zoo's forward builds ``torch.arange`` from its local length, wrong under CP; See [Note:
applying context parallelism]), its labels shifted ahead of the cut, on a mesh of shard 1 x cp 2:
both ranks read the same two sequences of 32 tokens, each keeping 16 of them. ``train_step`` runs
each step in ``plan.train_context`` and averages the loss over the cp ranks; the reference trains
the unsharded model on the whole sequences. fp32, AdamW, 3 steps: the losses agree within 1e-5
relative. CPU needs the CPU kernel added to torch's ring (See [Note: context parallelism on CPU]).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.ranks import STEPS, TOL, four_rank_case, reference, two_rank_case
from wrapopt.errors import PlanError
from wrapopt.models import zoo
from wrapopt.plan.cp import ROTATE_METHODS, head_tail_tokens, ring_exchanges
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec

SEQ = 32  # tokens per sequence: 2 x cp = 4 chunks of 8
MESH_CP = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2, cp_size=2)  # dp_shard 1 x cp 2


class GPTPos(zoo.GPT):
    """The zoo's GPT with its positions given (a buffer the context shards with the tokens); the
    labels ride in the micro-batch for the loss and are not read."""

    def forward(self, idx: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(pos)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def _loss(out: torch.Tensor, inputs: tuple) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), inputs[2].reshape(-1))


def _steps():
    toks = zoo.get_entry("gpt-tiny").inputs(batch=2)[0]
    return [(toks.roll(s, dims=0)[:, :SEQ].clone(), torch.arange(SEQ), toks.roll(s, dims=0)[:, 1:SEQ + 1].clone())
            for s in range(STEPS)]


def _comm_counts(cp_mesh, method: str) -> dict:
    """One SDPA forward and backward under ``cp_context``: each collective's calls and the
    elements of each call's input."""
    from torch.distributed.tensor.debug import CommDebugMode

    from wrapopt.plan.cp import cp_context

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    sizes: dict[str, set] = {}

    class Sized(CommDebugMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.get_total_counts()
            res = super().__torch_dispatch__(func, types, args, kwargs)
            if self.get_total_counts() > before:
                sizes.setdefault(func._overloadpacket.__name__, set()).add(args[0].numel())
            return res

    with cp_context(cp_mesh, [q, k, v], [2, 2, 2], no_restore=[q, k, v], rotate_method=method):
        for t in (q, k, v):
            t.requires_grad_(True)
        with Sized() as mode:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items() if n}
    return {"counts": counts, "sizes": {op: sorted(s) for op, s in sizes.items()}, "kv_shard": 2 * k.numel()}


@two_rank_case
def cp_cases(rank, world, tmp, out):
    from wrapopt.fingerprint import model_fingerprint
    from wrapopt.plan.cp import cp_mesh_of
    from wrapopt.plan.file import WrapPlan
    from wrapopt.plan.step import train_step

    ref = reference("gpt-tiny")
    ref.__class__ = GPTPos
    model = copy.deepcopy(ref)
    spec = PlanSpec((UnitSpec(("layers.0", "layers.1")), UnitSpec(("layers.2", "layers.3"), checkpoint=True),
                     UnitSpec((ROOT,), False)), MESH_CP)  # blocks in pairs, one pair recomputed in backward
    plan = WrapPlan(spec=spec, model=model_fingerprint(model))
    model = plan.apply(model, strict=False)
    mesh = model.wte.weight.device_mesh
    out["cp/fsdp_mesh"] = (mesh.mesh_dim_names, mesh.size())
    pos = torch.arange(SEQ)
    with plan.train_context(model, buffers=[pos], seq_dims=[0]):
        out["cp/held"] = pos.tolist()
    out["cp/restored"] = pos.tolist() == list(range(SEQ))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out["cp/losses"], out["cp/ref"], seen = [], [], []
    model.register_forward_pre_hook(lambda m, args: seen.append((args[0].shape[1], args[1].tolist())))
    for x, p, y in _steps():
        out["cp/losses"].append(train_step(model, opt, [(x, p, y)], _loss, plan=plan, seq_dims=[1, 0, 1]))
        loss = _loss(ref(x, p), (x, p, y))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["cp/ref"].append(float(loss.detach()))
    out["cp/seen"] = seen
    out["cp/comm"] = {m: _comm_counts(cp_mesh_of(model), m) for m in ROTATE_METHODS}
    out["cp/non_causal"] = _non_causal(cp_mesh_of(model), rank)
    out["cp/hf"] = _hf_llama(rank)


def _non_causal(cp_mesh, rank: int) -> tuple:
    """Non-causal SDPA under ``cp_context``: refused with the balancer (the error names the fix);
    without it, (the largest difference from the unsharded attention's rows this rank holds, the
    largest from its input gradients)."""
    from wrapopt.plan.cp import cp_context

    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    F.scaled_dot_product_attention(*full).square().sum().backward()
    refused = None
    try:
        with cp_context(cp_mesh, [q.clone()], [2]):
            F.scaled_dot_product_attention(q, k, v)
    except PlanError as e:
        refused = str(e)
    with cp_context(cp_mesh, [q, k, v], [2, 2, 2], no_restore=[q, k, v], load_balance=False):
        for t in (q, k, v):
            t.requires_grad_(True)
        out = F.scaled_dot_product_attention(q, k, v)
        out.square().sum().backward()
    mine = slice(8 * rank, 8 * rank + 8)  # contiguous halves without the balancer
    want = F.scaled_dot_product_attention(*(t.detach() for t in full))[:, :, mine]
    return refused, float((out - want).abs().max()), float((q.grad - full[0].grad[:, :, mine]).abs().max())


@four_rank_case
def cp_hsdp(rank, world, out):
    """HSDP under cp on 4 ranks: replicate 2 x (dp_shard 1 x cp 2), each cp pair reading its half of
    the batch, 2 steps of ``train_step`` against the unsharded model on the whole batch."""
    import torch.distributed as dist

    from wrapopt.fingerprint import model_fingerprint
    from wrapopt.plan.file import WrapPlan
    from wrapopt.plan.step import train_step

    ref = reference("gpt-tiny")
    ref.__class__ = GPTPos
    model = copy.deepcopy(ref)
    spec = PlanSpec((UnitSpec(("layers.0", "layers.1", "layers.2", "layers.3")), UnitSpec((ROOT,), False)),
                    MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, cp_size=2))
    plan = WrapPlan(spec=spec, model=model_fingerprint(model))
    model = plan.apply(model, strict=False)
    mesh = model.wte.weight.device_mesh
    out["mesh"] = (mesh.mesh_dim_names, tuple(mesh.shape))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    out["losses"], out["ref"] = [], []
    for x, p, y in _steps()[:2]:
        mine = [t.chunk(2)[rank // 2].clone() for t in (x, y)]  # the batch axis: replicate (cp pairs 0-1, 2-3)
        loss = torch.tensor(train_step(model, opt, [(mine[0], p, mine[1])], _loss, plan=plan, seq_dims=[1, 0, 1]))
        dist.all_reduce(loss)
        out["losses"].append(float(loss) / world)
        want = _loss(ref(x, p), (x, p, y))
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref"].append(float(want.detach()))


def _hf_llama(rank: int) -> list[tuple[float, float]]:
    """The tiny Hugging Face Llama (SDPA attention) with ``position_ids`` given, in a loop of the
    user's own around ``plan.train_context``, rotating by all-to-all: (cp loss, unsharded loss) per step."""
    import torch.distributed as dist

    from tests.ranks import tiny_hf_llama
    from wrapopt.fingerprint import model_fingerprint
    from wrapopt.plan.file import WrapPlan

    ref = tiny_hf_llama()
    ref.config._attn_implementation = "sdpa"
    model = copy.deepcopy(ref)
    spec = PlanSpec((UnitSpec(("model.layers.0",)), UnitSpec(("model.layers.1",)), UnitSpec((ROOT,), False)), MESH_CP)
    plan = WrapPlan(spec=spec, model=model_fingerprint(model))
    model = plan.apply(model, strict=False)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    toks = torch.randint(0, 1000, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    losses = []
    for s in range(2):
        t = toks.roll(s, dims=1)
        x, y, pos = t[:, :SEQ].clone(), t[:, 1:].clone(), torch.arange(SEQ).expand(2, SEQ).clone()
        with plan.train_context(model, buffers=[x, y, pos], seq_dims=[1, 1, 1], rotate_method="alltoall"):
            out = model(input_ids=x, position_ids=pos).logits
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out = ref(input_ids=x, position_ids=pos).logits
        want = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((float(mean) / 2, float(want.detach())))
    return losses


@pytest.mark.multiprocess
def test_cp_trains_like_the_unsharded_model(two_rank_cases):
    for r in two_rank_cases:
        assert r["cp/fsdp_mesh"] == (("dp_shard_cp",), 2)  # FSDP over dp_shard x cp flattened
        assert len(r["cp/losses"]) == STEPS
        assert r["cp/seen"] == [(SEQ // 2, r["cp/held"])] * STEPS  # the model saw this rank's half only
        for got, want in zip(r["cp/losses"], r["cp/ref"]):
            assert abs(got - want) <= TOL * abs(want), (r["cp/losses"], r["cp/ref"])
    assert two_rank_cases[0]["cp/ref"][0] != two_rank_cases[0]["cp/ref"][-1]  # the steps moved the model


@pytest.mark.multiprocess
def test_hsdp_with_cp_trains_like_the_unsharded_model(four_rank_cases):
    for res in four_rank_cases:
        r = res[__name__]
        assert r["mesh"] == (("replicate", "dp_shard_cp"), (2, 2))
        assert r["ref"][0] != r["ref"][1]
        for got, want in zip(r["losses"], r["ref"]):
            assert abs(got - want) <= TOL * abs(want), (r["losses"], r["ref"])


@pytest.mark.multiprocess
def test_cp_trains_a_hugging_face_llama_like_the_unsharded_one(two_rank_cases):
    pytest.importorskip("transformers")
    for r in two_rank_cases:
        assert len(r["cp/hf"]) == 2 and r["cp/hf"][0][1] != r["cp/hf"][1][1]
        for got, want in r["cp/hf"]:
            assert abs(got - want) <= TOL * abs(want), r["cp/hf"]


@pytest.mark.multiprocess
def test_each_cp_rank_holds_its_head_and_tail_chunks(two_rank_cases):
    held = [r["cp/held"] for r in two_rank_cases]
    assert held[0] == [*range(0, 8), *range(24, 32)] and held[1] == [*range(8, 16), *range(16, 24)]
    assert held == [head_tail_tokens(SEQ, 2, rank) for rank in range(2)]
    assert all(r["cp/restored"] for r in two_rank_cases)  # the buffer is whole again after the context


@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ROTATE_METHODS)
def test_ring_exchanges_match_torch_collectives(two_rank_cases, method):
    for r in two_rank_cases:
        got = r["cp/comm"][method]
        want: dict[str, int] = {}
        for collective, calls, _ in ring_exchanges(2, method).values():
            want[collective] = want.get(collective, 0) + calls
        assert got["counts"] == want
        assert got["sizes"] == {op: [got["kv_shard"]] for op in want}  # every call moves one k, v shard


@pytest.mark.multiprocess
def test_non_causal_attention_runs_without_the_balancer(two_rank_cases):
    for r in two_rank_cases:
        refused, out_err, grad_err = r["cp/non_causal"]
        assert refused is not None and "needs causal attention" in refused and "load_balance=False" in refused
        assert out_err < 1e-5 and grad_err < 1e-5


def test_head_tail_tokens_are_torchs_balancer():
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    for seq, cp in ((16, 2), (24, 3), (32, 4)):
        order = _HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices()[0].tolist()
        assert order == [t for rank in range(cp) for t in head_tail_tokens(seq, cp, rank)]


def test_ring_exchanges_count_the_ring():
    assert ring_exchanges(1) == {}
    ag, a2a = ring_exchanges(4, "allgather"), ring_exchanges(4, "alltoall")
    assert ag["forward_kv"] == ("all_gather_into_tensor", 1, 3) and a2a["forward_kv"] == ("all_to_all_single", 3, 3)
    assert ag["backward_grad_kv"] == a2a["backward_grad_kv"] == ("all_to_all_single", 4, 4)
    with pytest.raises(PlanError, match="rotate method 'ring'.*allgather, alltoall"):
        ring_exchanges(2, "ring")
