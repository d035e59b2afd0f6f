"""WrapPlan (plan/file.py): provenance from a search, the file format (round trip,
atomic write, malformed files) and the model check."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from tests.ranks import MESH2
from wrapopt.cost import simulate
from wrapopt.errors import PlanError, PlanMismatchError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.plan.file import PLAN_FORMAT, WrapPlan
from wrapopt.search.baselines import BASELINE_NAMES, baselines
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec
from wrapopt.units import validate_plan

MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


def _from_search(graph, model, spec: PlanSpec) -> WrapPlan:
    fabric = analytical_fabric(world_size=spec.mesh.world_size, ranks_per_node=spec.mesh.ranks_per_node)
    compute = analytical_compute()
    estimate = simulate(graph, spec, fabric, compute, record=True)
    scored = {name: simulate(graph, b, fabric, compute).summary_json()
              for name, b in baselines(graph, spec.mesh).items()}
    return WrapPlan.from_search(
        spec, model, estimate,
        fabric={"name": fabric.name, "kind": fabric.kind, "world_size": fabric.world_size},
        baselines=scored,
    )


@pytest.fixture(scope="module")
def gpt_baselines(gpt_tiny):
    _, _, graph = gpt_tiny
    return baselines(graph, MESH)


@pytest.fixture
def per_block_plan(gpt_tiny, gpt_baselines) -> WrapPlan:
    model, _, graph = gpt_tiny
    return _from_search(graph, model, gpt_baselines["per-block"])


@pytest.fixture
def rich_plan(gpt_tiny) -> WrapPlan:
    """A plan that uses every per-unit field: a grouped unit, hpZ resharding,
    checkpointing, explicit prefetch, an HSDP mesh and a label."""
    model, _, graph = gpt_tiny
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=8)
    units = (
        UnitSpec(("layers.0", "layers.1"), 2, True),
        UnitSpec(("layers.2",), False, False),
        UnitSpec(("layers.3",), True, True),
        UnitSpec((ROOT,), False),
    )
    spec = PlanSpec(units=units, mesh=mesh, forward_prefetch=1, label="rich")
    validate_plan(graph, spec)
    return _from_search(graph, model, spec)


# --- baselines and from_search ------------------------------------------------------------------


def test_baselines_are_legal_and_named(gpt_tiny, gpt_baselines):
    _, _, graph = gpt_tiny
    assert tuple(gpt_baselines) == BASELINE_NAMES
    for name, spec in gpt_baselines.items():
        validate_plan(graph, spec)
        assert spec.label == name and spec.units[-1].is_root
    assert [u.modules for u in gpt_baselines["per-block"].units] == [
        ("layers.0",), ("layers.1",), ("layers.2",), ("layers.3",), (ROOT,)]
    assert gpt_baselines["no-shard"].mesh.shard_size == 1


def test_from_search_records_provenance(per_block_plan, gpt_tiny):
    model, _, _ = gpt_tiny
    p = per_block_plan
    assert p.model == model_fingerprint(model)
    assert p.model["num_params"] == sum(q.numel() for q in model.parameters())
    assert p.prediction["step_s"] > 0 and p.prediction["peak_bytes"] > 0 and p.prediction["timeline"]
    assert p.fabric["kind"] == "analytical"
    assert set(p.baselines) == set(BASELINE_NAMES)
    assert p.created and p.wrapopt_version


# --- file round trip --------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["per_block_plan", "rich_plan"])
def test_save_load_round_trip(which, request, tmp_path):
    plan: WrapPlan = request.getfixturevalue(which)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = WrapPlan.load(path)
    assert loaded.units == plan.units
    assert loaded.mesh == plan.mesh
    assert loaded.spec.forward_prefetch == plan.spec.forward_prefetch
    assert loaded.spec.label == plan.spec.label
    assert loaded.spec == plan.spec
    assert loaded.to_json() == plan.to_json()
    # Saving what was loaded gives the same bytes.
    again = tmp_path / "again.json"
    loaded.save(again)
    assert again.read_text() == path.read_text()


def test_round_trip_keeps_hsdp_hpz_and_checkpoint(rich_plan, tmp_path):
    rich_plan.save(tmp_path / "p.json")
    loaded = WrapPlan.load(tmp_path / "p.json")
    assert loaded.units[0] == UnitSpec(("layers.0", "layers.1"), 2, True)
    assert loaded.units[1].reshard_after_forward is False
    assert loaded.mesh.is_hsdp and loaded.mesh.replicate_size == 2
    assert loaded.spec.forward_prefetch == 1 and loaded.spec.label == "rich"


def test_file_is_plain_json(per_block_plan, tmp_path):
    path = tmp_path / "plan.json"
    per_block_plan.save(path)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)  # the standard library alone
    assert data["format"] == PLAN_FORMAT == "wrapopt.plan/1"
    assert data["units"][-1] == {"modules": [""], "reshard_after_forward": False, "checkpoint": False}
    assert [u["modules"] for u in data["units"][:-1]] == [[f"layers.{i}"] for i in range(4)]
    assert data["mesh"]["world_size"] == 8 and data["mesh"]["axis_names"] == ["shard"]
    assert data["model"]["class"] == "GPT"
    assert data["label"] == "per-block"
    assert set(data["baselines"]) == set(BASELINE_NAMES)


def test_save_is_atomic_and_leaves_no_temp_files(per_block_plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("old contents")
    per_block_plan.save(path)
    per_block_plan.save(path)  # overwrite an existing plan
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]
    assert WrapPlan.load(path).spec == per_block_plan.spec


def test_failed_save_leaves_old_file_and_no_temp(per_block_plan, tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    per_block_plan.save(path)
    good = path.read_text()
    per_block_plan.spec = PlanSpec(units=per_block_plan.units, mesh=MESH, label="changed")

    def fail_replace(src, dst):  # the temp file is written, then the rename fails
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", fail_replace)
    with pytest.raises(OSError, match="simulated"):
        per_block_plan.save(path)
    monkeypatch.undo()
    assert path.read_text() == good
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


# --- malformed files ------------------------------------------------------------------------------


def _write(tmp_path, data, name="bad.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _mutated(plan: WrapPlan, change) -> dict:
    data = copy.deepcopy(plan.to_json())
    change(data)
    return data


def test_not_json_names_the_file(tmp_path):
    path = _write(tmp_path, "{ this is not json")
    with pytest.raises(PlanError, match="not valid JSON") as exc:
        WrapPlan.load(path)
    assert path in str(exc.value)


def test_missing_file_names_the_file(tmp_path):
    path = str(tmp_path / "nope.json")
    with pytest.raises(PlanError) as exc:
        WrapPlan.load(path)
    assert path in str(exc.value)


def test_json_that_is_not_an_object(tmp_path):
    path = _write(tmp_path, "[1, 2]")
    with pytest.raises(PlanError) as exc:
        WrapPlan.load(path)
    assert path in str(exc.value)


def _set(key_path: str, value):
    def change(d):
        *parents, last = key_path.split(".")
        for k in parents:
            d = d[int(k)] if isinstance(d, list) else d[k]
        d[int(last) if isinstance(d, list) else last] = value

    return change


def _drop(key: str):
    return lambda d: d.pop(key)


@pytest.mark.parametrize(
    "change, field",
    [
        (_set("format", "wrapopt.fabric/1"), "format"),
        (_set("format", "something-else"), "format"),
        (_set("format", "wrapopt.plan/99"), "format"),
        (_set("format", "wrapopt.plan/x"), "format"),
        (_drop("units"), "units"),
        (_set("units", []), "units"),
        (_set("units.0.reshard_after_forward", "yes"), "units[0].reshard_after_forward"),
        (_set("units.0.reshard_after_forward", 0), "units[0].reshard_after_forward"),
        (_set("units.1.checkpoint", "no"), "units[1].checkpoint"),
        (_set("units.2.modules", []), "units[2].modules"),
        (_set("units.2.modules", "layers.2"), "units[2].modules"),
        (_set("mesh.world_size", 0), "mesh.world_size"),
        (_set("mesh.world_size", "8"), "mesh.world_size"),
        (_drop("mesh"), "mesh"),
        (_set("mesh.shard_size", 3), "mesh"),
        (_drop("model"), "model"),
        (_set("forward_prefetch", -1), "forward_prefetch"),
        (_set("mixed_precision", {"param_dtype": "int3"}), "mixed_precision"),
    ],
)
def test_malformed_field_names_file_and_field(per_block_plan, tmp_path, change, field):
    path = _write(tmp_path, _mutated(per_block_plan, change))
    with pytest.raises(PlanError) as exc:
        WrapPlan.load(path)
    msg = str(exc.value)
    assert path in msg
    assert field in msg


@pytest.mark.parametrize("field, value", [("prediction", [1, 2]), ("fabric", "abc"), ("baselines", 5)])
def test_provenance_fields_must_be_objects(per_block_plan, tmp_path, field, value):
    path = _write(tmp_path, _mutated(per_block_plan, _set(field, value)))
    with pytest.raises(PlanError) as exc:
        WrapPlan.load(path)
    assert path in str(exc.value) and field in str(exc.value)


def test_newer_format_says_upgrade(per_block_plan, tmp_path):
    path = _write(tmp_path, _mutated(per_block_plan, _set("format", "wrapopt.plan/99")))
    with pytest.raises(PlanError, match="newer") as exc:
        WrapPlan.load(path)
    assert "wrapopt.plan/99" in str(exc.value)


def test_units_must_end_with_root(per_block_plan, tmp_path):
    path = _write(tmp_path, _mutated(per_block_plan, lambda d: d["units"].pop()))
    with pytest.raises(PlanError, match="root") as exc:
        WrapPlan.load(path)
    assert path in str(exc.value) and "units" in str(exc.value)


# --- the model check -------------------------------------------------------------------------------


def test_check_model_accepts_the_planned_model(per_block_plan, tmp_path):
    model, _ = zoo.build("gpt-tiny", "meta")
    per_block_plan.check_model(model)
    per_block_plan.save(tmp_path / "p.json")
    WrapPlan.load(tmp_path / "p.json").check_model(model)


def test_check_model_on_another_model_names_what_differs(per_block_plan):
    llama, _ = zoo.build("llama-tiny", "meta")
    with pytest.raises(PlanMismatchError) as exc:
        per_block_plan.check_model(llama)
    msg = str(exc.value)
    assert isinstance(exc.value, PlanError)
    assert "GPT" in msg and "Llama" in msg
    assert "parameters only in the plan: layers.0.attn.k_proj.bias" in msg
    assert "parameters only in the model: embed_tokens.weight" in msg


def test_check_model_names_modules_the_model_lacks(gpt_tiny):
    gpt, _, _ = gpt_tiny
    llama, _ = zoo.build("llama-tiny", "meta")
    spec = PlanSpec(units=(UnitSpec(("layers.0",)), UnitSpec(("wpe",)), UnitSpec((ROOT,), False)), mesh=MESH)
    plan = WrapPlan(spec=spec, model=model_fingerprint(gpt))
    with pytest.raises(PlanMismatchError, match="modules in the plan but not in the model: wpe"):
        plan.check_model(llama)


def test_check_model_names_changed_shapes():
    small, _ = zoo.build("gpt-tiny", "meta")
    with torch.device("meta"):
        wide = zoo.GPT(vocab=2048, dim=64, n_layers=4, n_heads=4, max_seq=128)
    plan = WrapPlan(spec=PlanSpec(units=(UnitSpec((ROOT,), False),), mesh=MESH), model=model_fingerprint(small))
    with pytest.raises(PlanMismatchError, match=r"wpe\.weight \[64, 64\]->\[128, 64\]"):
        plan.check_model(wide)


def test_check_model_names_modules_whose_class_differs(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = WrapPlan(spec=baselines(graph, MESH2)["per-block"], model=model_fingerprint(model))
    llama = zoo.get_entry("llama-tiny").build("meta")
    with pytest.raises(PlanMismatchError) as exc:
        plan.check_model(llama)
    msg = str(exc.value)
    assert "modules whose class differs: <root> (GPT in the plan, Llama here), layers.0 (GPTBlock in the plan, " \
           "LlamaBlock here)" in msg
    assert msg.index("modules that differ") < msg.index("parameters only in the plan")


def test_check_model_accepts_the_same_weights_under_another_class(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = WrapPlan(spec=baselines(graph, MESH2)["per-block"], model=model_fingerprint(model))
    renamed = zoo.get_entry("gpt-tiny").build("meta")
    renamed.layers[1].__class__ = type("OtherBlock", (zoo.GPTBlock,), {})  # e.g. eager vs SDPA attention
    plan.check_model(renamed)
