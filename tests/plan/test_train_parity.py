"""Multi-process: gradient accumulation and mixed precision train as they should.

The shared spawn of 2 gloo ranks (See tests/ranks.py) runs every case. Each step's global batch is k
micro-batches on each of 2 ranks; the unsharded reference trains the whole
batch at once. With a mean loss over equal micro-batches the gradients are
equal, so in fp32 the losses must match step for step (1e-5), in both sync
modes, gpt-tiny's tied embeddings included. bf16 plans must train, their
losses within BF16_TOL (relative) of the fp32 reference's.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from tests.ranks import two_rank_case, zoo_graph


TOL = 1e-5
# bf16 keeps 8 bits of mantissa (relative rounding 2^-8 = 0.4%); over 3 AdamW steps at lr 1e-2
# the loss of these tiny models stays within 1% of fp32's (seen on torch 2.13, CPU: at most 0.13%).
BF16_TOL = 0.01
STEPS = 3


def _cases():
    # (model, plan, micro-batches, precision, sync)
    return [
        ("gpt-tiny", "per-block", 3, "fp32", "every"),
        ("gpt-tiny", "per-block", 3, "fp32", "last"),
        ("gpt-tiny", "no-shard", 2, "fp32", "last"),
        ("llama-tiny", "per-block", 2, "fp32", "every"),
        ("llama-tiny", "per-block", 2, "fp32", "last"),
        ("gpt-tiny", "per-block", 2, "bf16", "last"),
        ("gpt-tiny", "size-1e8", 1, "bf16-pure", None),
        ("llama-tiny", "per-block", 2, "bf16", "every"),
    ]


def _worker(rank: int, world: int) -> dict:
    from wrapopt.fingerprint import model_fingerprint
    from wrapopt.models import zoo
    from wrapopt.plan.file import WrapPlan
    from wrapopt.plan.step import train_step
    from wrapopt.search.baselines import baselines
    from wrapopt.spec import MeshSpec
    from wrapopt.train import TrainConfig

    torch.manual_seed(0)
    out: dict = {}
    refs: dict = {}
    mesh = MeshSpec(world_size=world, ranks_per_node=world, shard_size=world)
    for name, plan_name, k, precision, sync in _cases():
        e = zoo.get_entry(name)
        per_rank = 2  # samples per micro-batch per rank
        full = [tuple(t.roll(s, dims=0) for t in e.inputs(batch=per_rank * k * world)) for s in range(STEPS)]
        key = (name, k)
        if key not in refs:  # the unsharded model on the whole batch, fp32
            ref = e.build("cpu", seed=0)
            opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            refs[key] = [train_step(ref, opt, [x], e.loss) for x in full]
        spec = baselines(zoo_graph(name), mesh)[plan_name]  # each model traced once per process
        train = TrainConfig.preset(precision, grad_accumulation=k, accumulation_sync=sync if k > 1 else None)
        model = e.build("cpu", seed=0)
        wplan = WrapPlan(spec=spec, model=model_fingerprint(model), train=train)
        wplan.apply(model)
        opt = train.make_optimizer(model.parameters(), lr=1e-2)
        losses = []
        for x in full:
            mine = [t.chunk(world)[rank] for t in x]
            micro = [tuple(t.chunk(k)[i] for t in mine) for i in range(k)]
            losses.append(train_step(model, opt, micro, e.loss, plan=wplan))
        t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(t)
        out[f"{name}/{plan_name}/k={k}/{precision}/{sync}"] = ([float(v) for v in t / world], refs[key])
        if precision != "fp32":
            x = tuple(t.chunk(world)[rank] for t in e.inputs(batch=per_rank * world))
            out[f"{name}/{precision}/output dtype"] = str(model(*x).dtype)
    dist.barrier()
    return out


@two_rank_case
def train_parity_case(rank: int, world: int, tmp: str, out: dict) -> None:
    out["train_parity"] = _worker(rank, world)


@pytest.fixture(scope="module")
def results(two_rank_cases):
    return two_rank_cases[0]["train_parity"]


@pytest.mark.multiprocess
def test_accumulation_matches_one_big_batch_fp32(results):
    fp32 = {k: v for k, v in results.items() if "/fp32/" in k}
    assert len(fp32) == 5
    assert any("/last" in k for k in fp32) and any("/every" in k for k in fp32)
    for key, (mine, ref) in fp32.items():
        for a, b in zip(mine, ref):
            assert abs(a - b) <= TOL * max(1.0, abs(b)), (key, mine, ref)


@pytest.mark.multiprocess
def test_bf16_plans_train_and_track_fp32(results):
    bf16 = {k: v for k, v in results.items() if "/bf16" in k and isinstance(v, tuple)}
    assert len(bf16) == 3
    for key, (mine, ref) in bf16.items():
        assert mine[-1] < mine[0], (key, mine)  # it trains
        for a, b in zip(mine, ref):
            assert abs(a - b) <= BF16_TOL * abs(b), (key, mine, ref)
    # plan.apply applied the plan's mixed precision: the forward ran in bf16
    assert results["gpt-tiny/bf16/output dtype"] == "torch.bfloat16"
    assert results["gpt-tiny/bf16-pure/output dtype"] == "torch.bfloat16"


@pytest.mark.multiprocess
def test_parity_report(results):
    """Not an assertion: the largest differences, printed with -s for the report."""
    worst = {k: max(abs(a - b) / abs(b) for a, b in zip(*v)) for k, v in results.items() if isinstance(v, tuple)}
    for k, w in sorted(worst.items()):
        print(f"{k}: max relative loss difference {w:.2e}")
    assert worst
