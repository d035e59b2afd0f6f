"""``wrapopt export --to fsdp1`` (interop/fsdp1.py): a module whose ``wrap(model)`` applies the
plan with FSDP1. The text alone, then the exported module training on 2 gloo ranks in the
shared spawn (See tests/ranks.py) alike the unsharded model."""

from __future__ import annotations

import copy
import importlib.util
import os
import warnings

import pytest
import torch

from tests.ranks import MESH2, TOL, batches, mean_over_ranks, plan_specs, train, two_rank_case, zoo_graph
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop import export_plan
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import baselines, make_plan
from wrapopt.spec import SELECTIVE_OP, MeshSpec


def _plan(graph, model, spec) -> WrapPlan:
    return WrapPlan(spec=spec, model=model_fingerprint(model))


def test_a_per_block_plan_is_exact_and_a_group_is_split(gpt_tiny):
    model, _, graph = gpt_tiny
    exact = export_plan(_plan(graph, model, baselines(graph, MESH2)["per-block"]), to="fsdp1", source="p.json")
    assert exact.target == "fsdp1" and exact.exact and "The plan is reproduced exactly." in exact.text
    assert "PLAN_PATH = 'p.json'" in exact.text and "split_groups=False" in exact.text
    assert "apply_activation_checkpointing" not in exact.text and "init_device_mesh" not in exact.text
    compile(exact.text, "fsdp1_wrap.py", "exec")
    grouped = export_plan(_plan(graph, model, make_plan(graph, MESH2, [("layers.0", "layers.1"), ("layers.2",)])),
                          to="fsdp1")
    assert grouped.losses == ("grouped units become one FSDP1 unit per module: layers.0 + layers.1",)
    assert "split_groups=True" in grouped.text and grouped.settings["split_groups"] is True


def test_checkpointing_and_hsdp_are_applied_by_the_module(gpt_tiny):
    model, _, graph = gpt_tiny
    hsdp = MeshSpec(world_size=4, ranks_per_node=2, shard_size=2)
    out = export_plan(_plan(graph, model, baselines(graph, hsdp)["per-block,ckpt"]), to="fsdp1")
    assert out.exact and out.settings["device_mesh"] == [2, 2] and out.settings["sharding_strategy"] == "HYBRID_SHARD"
    assert "init_device_mesh(device, (2, 2)" in out.text and "check_fn=plan.fsdp1_checkpoint_fn(model)" in out.text
    compile(out.text, "fsdp1_wrap.py", "exec")


def test_what_fsdp1_cannot_wrap_is_refused(gpt_tiny):
    model, _, graph = gpt_tiny
    spec = make_plan(graph, MESH2, list(graph.blocks), checkpoint=SELECTIVE_OP)
    with pytest.raises(PlanError, match="selective-op"):
        export_plan(_plan(graph, model, spec), to="fsdp1")


# --- the exported module on 2 ranks ----------------------------------------------------------------


def _load(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@two_rank_case
def fsdp1_export_cases(rank: int, world: int, tmp: str, out: dict) -> None:
    e = zoo.get_entry("gpt-tiny")
    graph = zoo_graph("gpt-tiny")
    ref = e.build("cpu", seed=0)
    full, mine = batches("gpt-tiny", world, rank)
    ref_losses = [float(v) for v in train(copy.deepcopy(ref), full, e.loss)]
    for label, spec in plan_specs(graph, MESH2).items():
        plan_path = os.path.join(tmp, f"fsdp1-export-{label}-{rank}.json")
        code_path = os.path.join(tmp, f"fsdp1_export_{label.replace('-', '_').replace('+', '_')}_{rank}.py")
        WrapPlan(spec=spec, model=model_fingerprint(ref)).save(plan_path)
        with open(code_path, "w", encoding="utf-8") as f:
            f.write(export_plan(WrapPlan.load(plan_path), to="fsdp1", source=plan_path, out=code_path).text)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the split group's note: listed in the file
            model = _load(code_path).wrap(copy.deepcopy(ref), device_id=torch.device("cpu"))
        out[f"fsdp1-export/{label}"] = {"ref": ref_losses, "losses": mean_over_ranks(train(model, mine, e.loss), world)}


@pytest.mark.multiprocess
def test_the_exported_module_trains_like_the_unsharded_model(two_rank_cases):
    r = two_rank_cases[0]
    for label in ("per-block", "groups-of-2", "keep+ckpt"):
        case = r[f"fsdp1-export/{label}"]
        assert case["losses"] == pytest.approx(case["ref"], abs=TOL), label
