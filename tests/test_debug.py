"""debug.py: full_tensor and memory_report on 2 gloo ranks, in the shared spawn
(See tests/ranks.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.ranks import MESH2, catch, plan_specs, two_rank_case, zoo_graph
from wrapopt.fingerprint import model_fingerprint
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan

pytestmark = pytest.mark.multiprocess


@two_rank_case
def inspect_cases(rank: int, world: int, tmp: str, out: dict) -> None:
    from wrapopt.debug import full_tensor, memory_report
    from wrapopt.errors import WrapoptError

    e = zoo.get_entry("gpt-tiny")
    ref = e.build("cpu", seed=0)
    model = copy.deepcopy(ref)
    WrapPlan(spec=plan_specs(zoo_graph("gpt-tiny"), MESH2)["per-block"], model=model_fingerprint(ref)).apply(model)
    out["inspect/q_proj"] = torch.equal(full_tensor(model, "layers.0.attn.q_proj.weight"),
                                        ref.layers[0].attn.q_proj.weight)
    out["inspect/tied"] = torch.equal(full_tensor(model, "lm_head.weight"), ref.wte.weight)
    out["inspect/typo"] = catch(lambda: full_tensor(model, "layers.0.attn.q_prj.weight"), WrapoptError)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_one = e.loss(model(*e.inputs()), e.inputs())
    _train_one.backward()
    opt.step()
    report = memory_report(model, opt)
    bare = memory_report(model)
    unique_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    out["inspect/report"] = {"table": str(report), "json": report.to_json(), "unique_bytes": unique_bytes,
                             "bare_categories": list(bare.categories)}


def test_full_tensor_gathers_sharded_and_tied_parameters(two_rank_cases):
    for r in two_rank_cases:
        assert r["inspect/q_proj"] and r["inspect/tied"]
        assert "q_prj" in r["inspect/typo"] and "layers.0.attn.q_proj.weight" in r["inspect/typo"]  # did you mean


def test_memory_report_is_one_table_on_every_rank(two_rank_cases):
    a, b = (r["inspect/report"] for r in two_rank_cases)
    assert a["json"] == b["json"]  # the same table on every rank
    rows, per_rank = a["json"]["rows"], a["json"]["per_rank"]
    assert a["json"]["world_size"] == 2 and a["json"]["device"] == "cpu"
    for cat in ("parameters (local shards)", "gradients (local shards)", "optimizer state (local)", "process RSS"):
        assert len(per_rank[cat]) == 2
        r = rows[cat]
        assert r["min"] <= r["median"] <= r["max"] and r["total"] == pytest.approx(sum(per_rank[cat]))
    # The local shards add up to the whole model (tied weights once); AdamW keeps two states per element.
    assert rows["parameters (local shards)"]["total"] == a["unique_bytes"]
    assert rows["optimizer state (local)"]["total"] >= 2 * a["unique_bytes"]
    assert rows["process RSS"]["min"] > 0
    assert "optimizer state (local)" not in a["bare_categories"]
    header = a["table"].splitlines()[0]
    assert all(w in header for w in ("min", "median", "max", "total"))
