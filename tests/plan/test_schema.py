"""The plan file's JSON schema (wrapopt/data/plan.schema.json): every plan the
code writes validates, and a malformed file names the file and the field."""

from __future__ import annotations

import copy
import json
import os

import pytest

from tests.ranks import MESH2, zoo_graph
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.models import zoo
from wrapopt.plan.file import PLAN_FORMAT, WrapPlan, plan_schema, schema_errors
from wrapopt.search.baselines import baselines
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec


@pytest.fixture(scope="module")
def written_plans():
    """Plans as the code writes them: every baseline of every zoo model, a search result,
    a rich hand-made plan (group, hpZ, checkpointing, HSDP, prefetch, mixed precision)."""
    from wrapopt.api import ParallelRequest, plan_model, prepare
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric
    from wrapopt.search.driver import SearchOptions

    out = {}
    for name in ("gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny"):
        model = zoo.get_entry(name).build("meta")
        graph = zoo_graph(name)
        for label, spec in baselines(graph, MESH2).items():
            out[f"{name}/{label}"] = WrapPlan(spec=spec, model=model_fingerprint(model))
        job = prepare(ParallelRequest(mesh=MESH2, memory_budget="none"), model, graph=graph,
                      fabric=analytical_fabric(world_size=2), compute=analytical_compute())
        plan, _ = plan_model(job, search=SearchOptions(trials=20, seed=0))  # 200 trials: 10x the time, same fields
        out[f"{name}/searched"] = plan
    gpt = zoo.get_entry("gpt-tiny").build("meta")
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=8)
    units = (UnitSpec(("layers.0", "layers.1"), 2, True), UnitSpec(("layers.2",), False),
             UnitSpec(("layers.3",), True, True),
             UnitSpec((ROOT,), False))
    out["rich"] = WrapPlan(spec=PlanSpec(units, mesh, forward_prefetch=1, label="rich"), model=model_fingerprint(gpt),
                           mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    return out


def test_schema_is_draft_2020_12_and_describes_the_format(repo_root):
    schema = plan_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["format"]["const"] == PLAN_FORMAT
    assert set(schema["required"]) == {"format", "model", "mesh", "units"}
    path = os.path.join(repo_root, "wrapopt", "data", "plan.schema.json")
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == schema


def test_every_plan_the_code_writes_validates(written_plans, tmp_path):
    plans = written_plans
    assert len(plans) >= 20
    for key, plan in plans.items():
        path = tmp_path / "p.json"
        plan.save(path)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        assert schema_errors(data) == [], key
        assert WrapPlan.load(path).to_json() == data, key
        try:  # the reference validator too, where it is installed (not a dependency)
            import jsonschema
        except ImportError:
            continue
        jsonschema.Draft202012Validator(plan_schema()).validate(data)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d["units"][0].update(reshard_after_foward=False), "units[0].reshard_after_foward"),
        (lambda d: d.update(unit=[]), "unit"),
        (lambda d: d["model"]["params"]["wte.weight"].update(shape=[2048, "64"]),
         "model.params['wte.weight'].shape[1]"),
        (lambda d: d["mesh"].update(axis_names=["data"]), "mesh.axis_names[0]"),
        (lambda d: d["prediction"].update(step_s="fast"), "prediction.step_s"),
        (lambda d: d["baselines"]["per-block"].update(fits="yes"), "baselines['per-block'].fits"),
        (lambda d: d.update(label=3), "label"),
    ],
)
def test_schema_errors_name_the_file_and_the_field(written_plans, tmp_path, change, field):
    data = copy.deepcopy(written_plans["gpt-tiny/searched"].to_json())  # to_json shares the plan's own dicts
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as exc:
        WrapPlan.load(path)
    assert str(path) in str(exc.value) and repr(field) in str(exc.value)
