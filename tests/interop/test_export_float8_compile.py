"""Float8 and per-block compile in the exports: TorchTitan writes its own keys ([compile], the
float8 converter and [quantize.linear.float8]), read back by TorchTitan 0.2.x's ConfigManager; the
other exports state them for the training script, or list them as lost."""

from __future__ import annotations

import tomllib

import pytest

from tests.interop.test_export_torchtitan import _plan, _titan_config, _titan_units
from tests.ranks import MESH2
from wrapopt.interop.export import export_plan
from wrapopt.interop.fields import LOST, STATED, WRITTEN
from wrapopt.spec import PlanSpec


@pytest.fixture(scope="module")
def knob_plans(llama_tiny):
    model, _, graph = llama_tiny
    spec = PlanSpec(_titan_units(graph.blocks), MESH2)
    return {"tensorwise": _plan(model, spec, micro_batch=2, compile=True, float8="tensorwise", float8_all_gather=True),
            "rowwise": _plan(model, spec, micro_batch=2, float8="rowwise"),
            "off": _plan(model, spec, micro_batch=2)}


def test_torchtitan_writes_compile_and_the_float8_converter(knob_plans, tmp_path):
    out = export_plan(knob_plans["tensorwise"], to="torchtitan")
    toml = tomllib.loads(out.text)
    assert toml["compile"] == {"enable": True, "components": ["model", "loss"]}
    assert toml["model"]["converters"] == ["quantize.linear.float8"]
    f8 = toml["quantize"]["linear"]["float8"]
    assert f8 == {"enable_fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale_for_fsdp": True,
                  "filter_fqns": ["output", "auto_filter_small_kn"]}  # tensorwise: recipe_name unset (0.2.x
    # refuses it with the all-gather); the head and torchao's small shapes skipped, as the plan was priced
    assert out.fields["compile"] == WRITTEN and out.fields["float8"] == WRITTEN
    row = tomllib.loads(export_plan(knob_plans["rowwise"], to="torchtitan").text)
    assert row["quantize"]["linear"]["float8"]["recipe_name"] == "rowwise" and "compile" not in row
    off = export_plan(knob_plans["off"], to="torchtitan")
    assert "quantize" not in tomllib.loads(off.text) and "float8" not in off.fields and "compile" not in off.fields
    config = _titan_config()
    for which in ("tensorwise", "rowwise"):
        path = tmp_path / f"{which}.toml"
        path.write_text(export_plan(knob_plans[which], to="torchtitan").text)
        job = config.ConfigManager().parse_args(["--job.config_file", str(path)])
        assert job.model.converters == ["quantize.linear.float8"]
        fl = job.quantize.linear.float8
        assert fl.filter_fqns == ["output", "auto_filter_small_kn"]
        assert fl.recipe_name == (None if which == "tensorwise" else "rowwise")
        gather = which == "tensorwise"
        assert fl.enable_fsdp_float8_all_gather == gather == fl.precompute_float8_dynamic_scale_for_fsdp
        assert job.compile.enable == (which == "tensorwise")


@pytest.mark.parametrize("to", ["accelerate", "lightning", "lightning-fsdp1", "fsdp1"])
def test_other_exports_state_or_lose_float8_and_compile(knob_plans, to):
    out = export_plan(knob_plans["tensorwise"], to=to)
    fsdp1 = to in ("fsdp1", "lightning-fsdp1")
    assert out.fields["compile"] in (WRITTEN, STATED)
    if fsdp1:  # the float8 all-gather is FSDP2's
        assert out.fields["float8"] == LOST
        assert any("FLOAT8 ALL-GATHER" in x and "--float8-all-gather" in x for x in out.losses)
    else:
        assert out.fields["float8"] == STATED
        assert any("after_optimizer_step(model)" in x for x in out.script)
    row = export_plan(knob_plans["rowwise"], to=to)
    assert row.fields["float8"] in (WRITTEN, STATED) and "compile" not in row.fields
    if to != "lightning":  # the lightning module calls WrapPlan.apply, which converts
        assert any('convert_float8(model, "rowwise")' in x for x in row.script), row.script
