"""Pipeline plans on 4 gloo ranks, 2 stages x 2 data-parallel ranks (mesh pp=2, shard=2), in the
shared spawn of 4 ranks (See tests/ranks.py): training parity with the unsharded model for llama-tiny and the tied
gpt-tiny under 1F1B and GPipe (and Interleaved1F1B, 4 stages on 2 pipeline ranks, for
gpt-tiny: its tied copies on stages 0 and 3), one unit per block with resharding after forward,
and without it with every other block checkpointed and explicit forward prefetch, and a bad stage list failing on every
rank before any collective.

[Note: what the pipeline parity compares] Pipeline rank r = rank // 2 holds stage r (stages r and
r + 2 when interleaved); data-parallel position d = rank % 2 trains on half d of the global batch,
split again into the plan's micro-batches by the schedule. The reference trains the unsharded
model on the same micro-batches (each data-parallel half, each micro-batch, in turn), backward of
each micro-batch's mean loss / (2 x micro-batches), so its gradient is the one the pipeline's
(scaled by 1 / micro-batches, averaged over the data-parallel ranks by FSDP) is. Losses (the last
stage's mean over its micro-batches, averaged over its data-parallel ranks) and, after SGD, every
stage's gathered parameters match within 1e-5; after AdamW, parameters within a tenth of its lr
(See [Note: what the TP parity compares] in test_tp_ranks.py).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.ranks import TOL, catch, four_rank_case, reference
from wrapopt.api import optimize_wrap
from wrapopt.errors import PlanError, RankFailedError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.launch import spawn
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import ROOT, MeshSpec, PipelineSpec, PlanSpec, UnitSpec

pytestmark = pytest.mark.multiprocess

STEPS = 2  # the second step's loss and gradient are of the parameters the first step updated
MB = 2  # sequences per micro-batch
MESH = MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, pp_size=2)
STAGES = {
    "llama-tiny": (("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.3", "layers.4", "layers.5", "norm",
                                                                           "lm_head")),
    "gpt-tiny": (("wte", "wpe", "layers.0", "layers.1"), ("layers.2", "layers.3", "ln_f", "lm_head")),
}
INTERLEAVED = (("wte", "wpe", "layers.0"), ("layers.1",), ("layers.2",), ("layers.3", "ln_f", "lm_head"))
# (model, schedule, reshard_after_forward, micro-batches, optimizer)
# Each schedule, each model (the tied gpt-tiny's copies summed across stages), with and without
# resharding, and AdamW once: one spawn of 4 ranks on 2 cores, so the cases are few. Each llama-tiny
# case costs a torch.export of llama-tiny per rank, 5x gpt-tiny's: llama runs 1F1B without resharding
# and GPipe with it; 1F1B with resharding and Interleaved1F1B are gpt-tiny's.
CASES = [("llama-tiny", "1F1B", False, 2, "sgd"),
         ("gpt-tiny", "1F1B", True, 2, "sgd"), ("gpt-tiny", "GPipe", False, 2, "sgd"),
         ("llama-tiny", "GPipe", True, 2, "sgd"), ("gpt-tiny", "Interleaved1F1B", True, 4, "sgd"),
         ("gpt-tiny", "1F1B", True, 2, "adamw")]


def case_key(c) -> str:
    return "/".join(map(str, c))


def lm_target_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The zoo's language-model loss with torch's schedule signature (the target is the tokens)."""
    return zoo.get_entry("gpt-tiny").loss(output, (target,))


def pipeline_spec(name: str, schedule: str, raf: bool, microbatches: int) -> PlanSpec:
    stages = INTERLEAVED if schedule == "Interleaved1F1B" else STAGES[name]
    blocks = [m for s in stages for m in s if m.startswith("layers.")]
    # Without resharding, every other block is checkpointed too, and each unit prefetches the next.
    units = tuple(UnitSpec((b,), raf, not raf and i % 2 == 0) for i, b in enumerate(blocks))
    units += (UnitSpec((ROOT,), False),)
    return PlanSpec(units, MESH, label=f"pp-{schedule}", forward_prefetch=0 if raf else 1,
                    pipeline=PipelineSpec(stages=stages, schedule=schedule, microbatches=microbatches))


def _optimizer(params, kind: str):
    return torch.optim.SGD(params, lr=0.1) if kind == "sgd" else torch.optim.AdamW(params, lr=1e-2)


def _global_batches(name: str, microbatches: int):
    e = zoo.get_entry(name)
    return [e.inputs(batch=2 * microbatches * MB)[0].roll(s, dims=0) for s in range(STEPS)]


def _reference(name: str, microbatches: int, kind: str):
    model = reference(name)
    opt = _optimizer(model.parameters(), kind)
    losses = []
    for x in _global_batches(name, microbatches):
        mbs = [mb for half in x.chunk(2) for mb in half.chunk(microbatches)]
        step = []
        for mb in mbs:
            loss = lm_target_loss(model(mb), mb)
            (loss / len(mbs)).backward()
            step.append(float(loss))
        opt.step()
        opt.zero_grad()
        losses.append(sum(step) / len(step))
    return model, losses


def _parity(rank: int, world: int, out: dict) -> None:
    refs = {}
    for case in CASES:
        t0 = time.perf_counter()
        name, schedule, raf, microbatches, kind = case
        if (name, microbatches, kind) not in refs:
            refs[name, microbatches, kind] = _reference(name, microbatches, kind)
        ref, ref_losses = refs[name, microbatches, kind]
        model = reference(name)
        spec = pipeline_spec(name, schedule, raf, microbatches)
        x0 = zoo.get_entry(name).inputs(batch=MB)
        run = WrapPlan(spec=spec, model=model_fingerprint(model)).apply(model, example_inputs=x0,
                                                                        loss_fn=lm_target_loss)
        opt = _optimizer(list(run.parameters()), kind)
        losses = []
        for x in _global_batches(name, microbatches):
            mine = x.chunk(2)[rank % 2]
            loss = run.step((mine,), target=mine)
            opt.step()
            opt.zero_grad()
            losses.append(None if loss is None else float(loss))
        every = [None] * world
        dist.all_gather_object(every, losses)
        # torch's stages (private names): what they keep of the outputs after the step
        stages = getattr(run.schedule, "_stages", None) or [run.schedule._stage]
        kept_outputs = sum(len(st.output_chunks) for st in stages)
        want = dict(ref.named_parameters(remove_duplicate=False))
        diffs = {n: float((p.full_tensor() - want[n].detach()).abs().max()) for n, p in run.named_parameters()}
        out[case_key(case)] = {
            "losses": every, "ref": ref_losses, "diffs": diffs, "stages": list(run.stage_indices),
            "first": run.is_first, "last": run.is_last, "seconds": time.perf_counter() - t0,
            "names": sorted(diffs), "tied": len(run.tied), "kept_outputs": kept_outputs,
            # See [Note: stage modules as code]: (graph modules run node by node, run as code)
            "interpreted": [sum(bool(getattr(m, "_run_with_interpreter", False)) for m in mod.modules())
                            for mod in run.modules],
            "as_code": [sum(getattr(m, "_run_with_interpreter", True) is False for m in mod.modules())
                        for mod in run.modules],
        }


def _errors(rank: int, world: int, out: dict) -> None:
    model = reference("llama-tiny")
    bad = pipeline_spec("llama-tiny", "1F1B", True, 2)
    stages = (("embed_tokens", "layers.0", "layers.1", "layers.3"), ("layers.2", "layers.4", "layers.5", "norm",
                                                                     "lm_head"))
    bad = PlanSpec(bad.units, MESH, pipeline=PipelineSpec(stages=stages, schedule="1F1B", microbatches=2))
    x0 = zoo.get_entry("llama-tiny").inputs(batch=MB)
    out["err/order"] = catch(lambda: WrapPlan(spec=bad, model={}).apply(model, strict=False, example_inputs=x0,
                                                                         loss_fn=lm_target_loss),
                             PlanError, RankFailedError)
    good = pipeline_spec("llama-tiny", "1F1B", True, 2)
    out["err/no-loss"] = catch(lambda: WrapPlan(spec=good, model={}).apply(model, strict=False, example_inputs=x0),
                               PlanError, RankFailedError)
    dist.barrier()  # every rank got here: no bad input left a rank waiting in a collective
    out["err/barrier"] = True


def _optimize(rank: int, world: int, out: dict) -> None:
    """optimize_wrap(pp=2) under the process group: the search's pipeline plan, applied; the user's loop
    gets this rank's PipelineRun (schedule and stage modules) and trains with it."""
    model = reference("gpt-tiny")  # gpt-tiny: its trace (torch.export, on every rank) is a fifth of llama-tiny's
    x = zoo.get_entry("gpt-tiny").inputs(batch=4 * MB)[0]
    res = optimize_wrap(model, (x,), world_size=4, gpus_per_node=4, fabric="a100+ib200", pp=2,
                        pipeline_loss_fn=lm_target_loss)
    run = res.model
    opt = torch.optim.SGD(list(run.parameters()), lr=0.1)
    mine = x.roll(rank % 2, dims=0)  # each data-parallel rank its own order of the batch it was planned for
    try:
        run.step((mine[:MB],), target=mine[:MB])
        out["optimize/wrong-batch"] = ""
    except PlanError as e:
        out["optimize/wrong-batch"] = str(e)
    losses = []
    for _ in range(2):
        loss = run.step((mine,), target=mine)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    out["optimize"] = {"kind": type(run).__name__, "schedule": type(run.schedule).__name__,
                       "pp": res.plan.mesh.pp_size, "stages": len(res.plan.spec.pipeline.stages),
                       "plan_schedule": res.plan.spec.pipeline.schedule, "losses": losses, "last": run.is_last,
                       "first": run.is_first}


@four_rank_case
def pipeline_cases(rank: int, world: int, out: dict) -> None:
    for case in (_errors, _optimize, _parity):
        t0 = time.perf_counter()
        case(rank, world, out)
        out.setdefault("case_s", {})[case.__name__] = round(time.perf_counter() - t0, 2)  # where the spawn's time goes


def _cases(rank: int, world: int) -> dict:  # for the quick run below
    torch.set_num_threads(1)
    out: dict = {}
    pipeline_cases(rank, world, out)
    return out


@pytest.fixture(scope="module")
def four_ranks(four_rank_cases) -> list[dict]:
    return [r[__name__] for r in four_rank_cases]


@pytest.mark.parametrize("case", CASES, ids=case_key)
def test_pipeline_training_matches_the_unsharded_model(four_ranks, case):
    name, schedule, _, _, kind = case
    r = four_ranks[0][case_key(case)]
    every = r["losses"]
    assert every[0] == every[1] == [None] * STEPS  # pipeline rank 0 holds no last stage
    mean = [(a + b) / 2 for a, b in zip(every[2], every[3])]
    assert every[2] != every[3]  # the two data-parallel ranks see different halves of the batch
    assert mean == pytest.approx(r["ref"], abs=TOL), (mean, r["ref"])
    assert r["ref"][0] != r["ref"][-1]  # it trained
    limit = TOL if kind == "sgd" else 1e-2 * 0.1  # See [Note: what the pipeline parity compares]
    for rank, got in enumerate(four_ranks):
        diffs = got[case_key(case)]["diffs"]
        assert max(diffs.values()) < limit, (rank, sorted(diffs.items(), key=lambda kv: -kv[1])[:3])
    # See [Note: the last stage's outputs] in wrapopt/plan/pipeline.py: the step keeps no micro-batch's output
    assert [four_ranks[k][case_key(case)]["kept_outputs"] for k in range(4)] == [0] * 4
    # See [Note: stage modules as code]: the parity above is of stages run as generated code
    for k in range(4):
        assert all(n == 0 for n in four_ranks[k][case_key(case)]["interpreted"])
        assert all(n > 0 for n in four_ranks[k][case_key(case)]["as_code"])
    per_rank = 2 if schedule == "Interleaved1F1B" else 1
    assert [len(four_ranks[k][case_key(case)]["stages"]) for k in range(4)] == [per_rank] * 4
    # Every parameter of the model is on some stage; a tied one on both ends (gpt-tiny).
    held = set(four_ranks[0][case_key(case)]["names"]) | set(four_ranks[2][case_key(case)]["names"])
    assert held == {n for n, _ in reference(name).named_parameters(remove_duplicate=False)}
    if name == "gpt-tiny":
        assert "wte.weight" in four_ranks[0][case_key(case)]["names"]
        assert "lm_head.weight" in four_ranks[2][case_key(case)]["names"]
        assert four_ranks[0][case_key(case)]["tied"] == 1 and four_ranks[2][case_key(case)]["tied"] == 1


def test_optimize_wrap_hands_the_user_the_pipeline(four_ranks):
    got = [r["optimize"] for r in four_ranks]
    assert all(g["kind"] == "PipelineRun" and g["pp"] == 2 for g in got)
    assert all(g["schedule"] == "Schedule" + g["plan_schedule"] for g in got)
    for g in got:
        if g["last"]:
            assert all(v is not None and v == v and v > 0 for v in g["losses"])  # finite losses on the last stage
        else:
            assert g["losses"] == [None, None]
    assert sum(g["last"] for g in got) == 2  # two data-parallel ranks hold the last stage
    for r in four_ranks:  # a batch of another size is named on the first and the last stage, before any send
        words = r["optimize/wrong-batch"]
        assert (not words) if not r["optimize"]["last"] and not r["optimize"]["first"] else "split for batches" in words


def test_bad_stages_fail_on_every_rank_before_any_collective(four_ranks):
    for r in four_ranks:
        assert r["err/barrier"]
        assert "layers.2" in r["err/order"] and "stage" in r["err/order"], r["err/order"]
        assert "loss_fn" in r["err/no-loss"], r["err/no-loss"]


if __name__ == "__main__":  # a quick run outside pytest: python -m tests.plan.test_pipeline_ranks
    import json
    import sys

    if len(sys.argv) > 1:
        CASES[:] = [c for c in CASES if case_key(c) in sys.argv[1:]]
    t0 = time.time()
    res = spawn(_cases, world_size=4, timeout_s=300)
    shown = {k: {kk: vv for kk, vv in v.items() if kk != "diffs"} | {"maxdiff": max(v["diffs"].values())}
             if isinstance(v, dict) and "diffs" in v else v for k, v in res[2].items()}
    print(json.dumps(shown, indent=1, default=str)[:6000])
    print("wall", time.time() - t0)
