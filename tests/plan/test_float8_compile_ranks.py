"""Multi-process: float8 (torchao, emulated on CPU) and per-block torch.compile (inductor's CPU
backend) applied by ``WrapPlan.apply`` on 2 gloo ranks train like the unsharded model converted the
same way; the compiled plan checkpoints every block (the forward is compiled inside the composable
checkpoint's hooks: See [Note: compiling per block]). The cases run in the shared spawn (See
tests/ranks.py); one model, 3 steps, compiled once, with inductor's pattern matcher off (its
patterns take ~10 s to set up on a busy 2-core machine, more than the rest of the compile with a
warm cache; it only chooses among equivalent fusions).

Tolerance: tensorwise float8 scales each activation by the amax of the tensor it sees; a rank sees
half the batch, so its scale (and e4m3's rounding, 3 mantissa bits) differs from the unsharded
model's. The losses agree within F8_TOL (relative) where fp32 agrees within 1e-5 (tests/ranks.py).
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from tests.ranks import MESH2, batches, catch, mean_over_ranks, plan_specs, two_rank_case, zoo_graph

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                 reason="float8 needs torchao: pip install 'wrapopt[float8]'")]

MODEL = "gpt-tiny"
F8_TOL = 0.01  # seen: 0.2% (tensorwise, step 3), 1e-7 (rowwise: a row's scale is the same on a shard)


def _steps(model, data, loss_fn, train) -> list[torch.Tensor]:
    from wrapopt.plan.step import train_step

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return [torch.tensor(train_step(model, opt, [x], loss_fn, train=train)) for x in data]


@two_rank_case
def float8_compile_case(rank: int, world: int, tmp: str, out: dict) -> None:
    if importlib.util.find_spec("torchao") is None:
        return
    import torch._inductor.config

    from wrapopt.fingerprint import model_fingerprint
    from wrapopt.models import zoo
    from wrapopt.plan.compile import compile_report
    from wrapopt.plan.file import WrapPlan
    from wrapopt.plan.float8 import convert_float8, float8_state
    from wrapopt.search.baselines import baselines
    from wrapopt.train import TrainConfig

    e = zoo.get_entry(MODEL)
    graph = zoo_graph(MODEL)
    spec = baselines(graph, MESH2)["per-block"]
    ckpt = plan_specs(graph, MESH2)["keep+ckpt"]  # every block checkpointed (composable checkpoint), kept gathered
    base = e.build("cpu", seed=0)
    full, mine = batches(MODEL, world, rank)
    res: dict = {}
    for label, train in (("compile+tensorwise+all-gather",
                          TrainConfig(compile=True, float8="tensorwise", float8_all_gather=True)),
                         ("rowwise", TrainConfig(float8="rowwise"))):
        ref = copy.deepcopy(base)
        convert_float8(ref, train.float8)
        ref_losses = [float(v) for v in _steps(ref, full, e.loss, None)]
        model = copy.deepcopy(base)
        plan = WrapPlan(spec=ckpt if train.compile else spec, model=model_fingerprint(model), train=train)
        err = catch(lambda: plan.apply(model), Exception)  # noqa: B023
        if err:
            res[label] = {"error": err}
            continue
        with torch._inductor.config.patch(pattern_matcher=False):
            losses = mean_over_ranks(_steps(model, mine, e.loss, train), world)
        state = float8_state(model)
        res[label] = {"losses": losses, "ref": ref_losses, "converted": len(state.converted),
                      "precompute": state.precompute,
                      "types": sorted({type(m).__name__ for m in model.layers[0].modules()}),
                      "compile": compile_report(model)}
    res["fp32"] = [float(v) for v in _steps(copy.deepcopy(base), full, e.loss, None)]
    res["optimize_wrap"] = catch(lambda: _optimize(copy.deepcopy(base), mine[0], spec, res), Exception)
    out["float8_compile"] = res


def _optimize(model, x, spec, res: dict) -> None:
    """optimize_wrap given a plan scored with float8 rowwise (no search: seconds) converts before
    fully_shard, as WrapPlan.apply does."""
    from wrapopt.api import optimize_wrap
    from wrapopt.fingerprint import model_fingerprint
    from wrapopt.plan.file import WrapPlan
    from wrapopt.plan.float8 import float8_state
    from wrapopt.train import TrainConfig

    plan = WrapPlan(spec=spec, model=model_fingerprint(model), train=TrainConfig(float8="rowwise"))
    got = optimize_wrap(model, x, world_size=2, gpus_per_node=2, fabric="h100", plan=plan)
    state = float8_state(got.model)
    res["optimize_wrap/float8"] = {"recipe": state.recipe if state else None, "plan": got.plan.train_config.float8,
                                   "fsdp": type(got.model).__name__}


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a, b))


def test_float8_and_compile_under_fsdp2_train_like_unsharded(two_rank_cases):
    res = two_rank_cases[0]["float8_compile"]
    for label in ("compile+tensorwise+all-gather", "rowwise"):
        r = res[label]
        assert "error" not in r, f"{label}: {r.get('error')}"
        assert "Float8Linear" in r["types"], r["types"]
        assert r["converted"] > 0
        assert len(r["losses"]) == 3 and _rel(r["losses"], r["ref"]) < F8_TOL, (label, r["losses"], r["ref"])
    both = res["compile+tensorwise+all-gather"]
    assert both["compile"]["compiled"] == [f"layers.{i}" for i in range(4)] and not both["compile"]["eager"]
    assert both["precompute"] and not res["rowwise"]["precompute"]  # train_step computed the all-gather's scales
    assert res["rowwise"]["compile"] is None
    assert res["optimize_wrap"] is None, res["optimize_wrap"]
    assert res["optimize_wrap/float8"]["recipe"] == res["optimize_wrap/float8"]["plan"] == "rowwise"
    assert res["optimize_wrap/float8"]["fsdp"].startswith("FSDP")
    # float8 moves the losses off fp32's: the comparison above is between float8 runs
    assert res["fp32"] != res["rowwise"]["ref"]
