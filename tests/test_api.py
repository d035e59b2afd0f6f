"""api.py: ``optimize_wrap`` under a process group of 2 gloo ranks (in the shared spawn, See
tests/ranks.py): it trains like the unsharded model, saves the plan on rank 0 only, and reuses a
saved plan or fabric profile without searching or measuring again.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch.distributed as dist

from tests.ranks import MESH2, TOL, batches, mean_over_ranks, train, two_rank_case, zoo_graph
from wrapopt.fingerprint import model_fingerprint
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.search import tp as search_tp
from wrapopt.search.baselines import baselines


def _optimize_worker(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from wrapopt import optimize_wrap

    e = zoo.get_entry("gpt-tiny")
    model = e.build("cpu", seed=0)
    # 16 trials: the case checks what reaches the ranks, not the study (200 trials: seconds of sampling)
    res = optimize_wrap(model, e.inputs(), loss_fn=e.loss, fabric="h100-nvlink-ib400", memory_budget="1GiB",
                        trials=16)
    x = e.inputs()
    loss = e.loss(res.model(*x), x)
    loss.backward()
    return {"units": [list(u.modules) for u in res.plan.units], "sharded": isinstance(res.model, FSDPModule),
            "loss": float(loss), "report": res.report()}


@two_rank_case
def api_optimize_case(rank: int, world: int, tmp: str, out: dict) -> None:
    out["api/optimize"] = _optimize_worker(rank, world)


@pytest.mark.multiprocess
def test_optimize_wrap_under_a_process_group(two_rank_cases):
    results = [r["api/optimize"] for r in two_rank_cases]
    assert results[0]["units"] == results[1]["units"]  # rank 0's plan reached every rank
    assert all(r["sharded"] for r in results)
    assert "ANALYTICAL" in results[0]["report"]


# --- a saved plan and a saved fabric profile -------------------------------------------------------------


class _Counter:
    def __init__(self, fn=None):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.fn is None:
            raise AssertionError("must not be called")
        return self.fn(*args, **kwargs)


def _reuse_worker(rank: int, world: int, tmp: str, budget: float) -> dict:
    """What ``optimize_wrap`` saves and reuses; the functions it counts calls of are put back
    however it ends (the shared spawn runs other cases after it)."""
    import wrapopt.api as api

    kept = (WrapPlan.save, api.plan_model, search_tp.search_plan, api.measure_fabric)
    try:
        return _reuse(rank, world, tmp, budget)
    finally:
        WrapPlan.save, api.plan_model, search_tp.search_plan, api.measure_fabric = kept  # type: ignore[method-assign]


def _reuse(rank: int, world: int, tmp: str, budget: float) -> dict:
    from torch.distributed.fsdp import FSDPModule

    import wrapopt.api as api
    from wrapopt import analytical_compute, optimize_wrap
    from wrapopt.hardware.measure_collectives import measure_fabric

    e = zoo.get_entry("gpt-tiny")
    compute = analytical_compute()  # given, so that no rank spends seconds measuring it
    ref = e.build("cpu", seed=0)
    full, mine = batches("gpt-tiny", world, rank)
    out: dict = {"ref": [float(v) for v in train(copy.deepcopy(ref), full, e.loss)]}
    plan_path, fabric_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "fabric.json")

    saved: list[str] = []
    original_save = WrapPlan.save

    def counting_save(self, path):
        saved.append(str(path))
        return original_save(self, path)

    WrapPlan.save = counting_save  # type: ignore[method-assign]
    res = optimize_wrap(copy.deepcopy(ref), e.inputs(), loss_fn=e.loss, fabric="h100-nvlink-ib400", compute=compute,
                        memory_budget=budget, save_plan=plan_path, trials=16)  # the saving, not the study
    out["sharded"] = isinstance(res.model, FSDPModule)
    out["units"] = [list(u.modules) for u in res.plan.units]
    out["losses"] = mean_over_ranks(train(res.model, mine, e.loss), world)
    out["saves"] = len(saved)
    WrapPlan.save = original_save  # type: ignore[method-assign]
    dist.barrier()  # rank 0 has written the plan

    counters = {"plan_model": _Counter(api.plan_model), "search_plan": _Counter(search_tp.search_plan),
                "measure_fabric": _Counter(None)}
    api.plan_model, search_tp.search_plan, api.measure_fabric = (counters["plan_model"], counters["search_plan"],
                                                                       counters["measure_fabric"])
    res2 = optimize_wrap(copy.deepcopy(ref), e.inputs(), loss_fn=e.loss, plan=plan_path)
    out["reuse_units"] = [list(u.modules) for u in res2.plan.units]
    out["reuse_sharded"] = isinstance(res2.model, FSDPModule)
    out["reuse_calls"] = {k: c.calls for k, c in counters.items()}
    api.plan_model, search_tp.search_plan = counters["plan_model"].fn, counters["search_plan"].fn

    api.measure_fabric = measure_fabric
    fab = api.measure_fabric(sizes_bytes=(4096, 65536), repeats=2, progress=False, measure_overlap=False)
    if rank == 0:
        fab.save(fabric_path)
    dist.barrier()
    api.measure_fabric = counters["measure_fabric"] = _Counter(None)
    res3 = optimize_wrap(copy.deepcopy(ref), e.inputs(), loss_fn=e.loss, fabric=fabric_path, compute=compute,
                         trials=16)
    out["fabric"] = {"kind": res3.fabric.kind, "name": res3.fabric.name, "saved": fab.name,
                     "measured_again": counters["measure_fabric"].calls, "sharded": isinstance(res3.model, FSDPModule)}
    return out


def _midway_budget() -> float:
    """A budget between the smallest baseline peak and the smallest of a single unit's:
    the plan must have units below the root."""
    from wrapopt.cost import Simulator
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric
    from wrapopt.search.driver import search_plan

    graph = zoo_graph("gpt-tiny")
    sim = Simulator(graph, analytical_fabric("h100-nvlink-ib400", world_size=2), analytical_compute())
    base = search_plan(graph, sim, MESH2).baselines.values()
    one_unit = min(s.estimate.peak_bytes for s in base if len(s.plan.units) == 1)
    return (min(s.estimate.peak_bytes for s in base) + one_unit) / 2


@two_rank_case
def api_reuse_case(rank: int, world: int, tmp: str, out: dict) -> None:
    tmp = os.path.join(tmp, "api-reuse")
    os.makedirs(tmp, exist_ok=True)
    out["api/reuse"] = (_reuse_worker(rank, world, tmp, _midway_budget()), tmp)


@pytest.fixture(scope="module")
def optimize_results(two_rank_cases):
    return [r["api/reuse"][0] for r in two_rank_cases], two_rank_cases[0]["api/reuse"][1]


@pytest.mark.multiprocess
def test_optimize_wrap_trains_like_the_unsharded_model(optimize_results):
    results, _ = optimize_results
    assert results[0]["units"] == results[1]["units"]  # rank 0's plan reached every rank
    assert all(r["sharded"] for r in results)
    assert len(results[0]["units"]) > 1  # the budget forced a sharded plan with units below the root
    r = results[0]
    assert r["losses"] == pytest.approx(r["ref"], abs=TOL)
    assert r["ref"][0] != r["ref"][-1]


@pytest.mark.multiprocess
def test_optimize_wrap_saves_the_plan_on_rank_0_only(optimize_results):
    results, tmp = optimize_results
    assert [r["saves"] for r in results] == [1, 0]
    saved = WrapPlan.load(os.path.join(tmp, "plan.json"))
    assert [list(u.modules) for u in saved.units] == results[0]["units"]


@pytest.mark.multiprocess
def test_optimize_wrap_reuses_a_saved_plan(optimize_results):
    results, _ = optimize_results
    for r in results:
        assert r["reuse_units"] == r["units"] and r["reuse_sharded"]
        assert r["reuse_calls"]["plan_model"] == 0  # no search for a plan
        assert r["reuse_calls"]["measure_fabric"] == 0  # and no profiling


@pytest.mark.multiprocess
def test_optimize_wrap_with_a_plan_runs_no_search_at_all(optimize_results):
    results, _ = optimize_results
    assert all(r["reuse_calls"]["search_plan"] == 0 for r in results)


def test_optimize_wrap_report_shows_the_given_plan(gpt_tiny, tmp_path):
    from wrapopt import optimize_wrap

    model, inputs, graph = gpt_tiny
    path = tmp_path / "every-leaf.json"
    WrapPlan(spec=baselines(graph, MESH2)["every-leaf"], model=model_fingerprint(model)).save(path)
    res = optimize_wrap(model, inputs, loss_fn=zoo.ZOO["gpt-tiny"].loss, world_size=2, plan=path)
    assert res.plan.spec.label == "every-leaf"
    assert res.search.best.plan.units == res.plan.units


@pytest.mark.multiprocess
def test_optimize_wrap_reuses_a_saved_fabric_profile(optimize_results):
    results, _ = optimize_results
    for r in results:
        f = r["fabric"]
        assert f["kind"] == "measured" and f["name"] == f["saved"]
        assert f["measured_again"] == 0 and f["sharded"]
