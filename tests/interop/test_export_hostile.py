"""interop/export.py under a hostile plan file: no string from the file becomes code in the
Lightning script or breaks out of its place in the Accelerate YAML (issue 33)."""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest

from tests.plan.common import load_data
from tests.ranks import MESH2
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop.export import export_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import make_plan

EVIL = "\nimport os; os.system('touch /tmp/pwned') #'\"\u2028x"


def _plan_json(gpt_tiny) -> dict:
    model, _, graph = gpt_tiny
    spec = make_plan(graph, MESH2, list(graph.blocks))
    return WrapPlan(spec=spec, model=model_fingerprint(model)).to_json()



def _calls(text: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call):
            names.add(ast.unparse(node.func))
    return names


# What the FSDP2 module calls, whatever the plan file says.
_FSDP2_CALLS = {"ModelParallelStrategy", "getattr", "WrapPlan.load", "WrapPlan.load(plan_path()).apply", "plan_path",
                "os.environ.get", "os.path.join", "os.path.dirname", "os.path.abspath"}


def _yaml_lines_ok(text: str) -> None:
    """Every line is a comment, blank, or `key: value` with a known key; none runs code."""
    for line in text.split("\n"):
        body = line.strip()
        assert not body or body.startswith("#") or body.split(":", 1)[0] in _YAML_KEYS, line
    assert "\u2028" not in text and "\r" not in text


_YAML_KEYS = {"compute_environment", "distributed_type", "mixed_precision", "num_machines", "num_processes",
              "machine_rank", "fsdp_config", "fsdp_version", "fsdp_auto_wrap_policy",
              "fsdp_transformer_layer_cls_to_wrap", "fsdp_reshard_after_forward", "fsdp_activation_checkpointing",
              "fsdp_offload_params", "fsdp_state_dict_type"}  # and comments (multi-node: what to fill in)


def test_hostile_label_model_class_and_source_stay_in_comments(gpt_tiny, tmp_path):
    data = _plan_json(gpt_tiny)
    data["label"] = "dp" + EVIL
    data["model"]["class"] = "GPT" + EVIL
    plan = load_data(tmp_path, data)
    lit = export_plan(plan, to="lightning-fsdp1", source="p.json" + EVIL)
    assert _calls(lit.text) == {"FSDPStrategy"}
    fsdp2 = export_plan(plan, to="lightning", source="p.json" + EVIL)
    assert _calls(fsdp2.text) == _FSDP2_CALLS
    if importlib.util.find_spec("lightning") is not None:  # run it: the path is a string, nothing more
        namespace: dict = {}
        exec(compile(fsdp2.text, "planned.py", "exec"), namespace)
        assert namespace["PLAN_PATH"] == os.path.relpath("p.json" + EVIL)
    acc = export_plan(plan, to="accelerate", source="p.json" + EVIL)
    _yaml_lines_ok(acc.text)
    assert "os.system" in acc.text and "\\n" in acc.text  # still said, escaped


def test_hostile_class_name_is_refused_naming_the_field(gpt_tiny, tmp_path):
    data = _plan_json(gpt_tiny)
    classes = data["model"]["module_classes"]
    key = next(k for k in classes if k.endswith("GPTBlock"))
    classes[key + EVIL] = classes.pop(key)
    plan = load_data(tmp_path, data)
    for to in ("lightning-fsdp1", "lightning", "accelerate"):
        with pytest.raises(PlanError, match="module_classes") as e:
            export_plan(plan, to=to)
        assert "\n" not in str(e.value)


def test_hostile_module_names_stay_in_comments(gpt_tiny, tmp_path):
    data = _plan_json(gpt_tiny)
    classes = data["model"]["module_classes"]
    key = next(k for k in classes if k.endswith("GPTBlock"))
    evil = "layers.0" + EVIL
    classes[key] = [evil if m == "layers.0" else m for m in classes[key]]
    # a grouped unit names its modules in the LOSSES section
    data["units"] = [{"modules": [evil, "layers.1"]}, *data["units"][2:]]
    plan = load_data(tmp_path, data)
    lit = export_plan(plan, to="lightning-fsdp1")
    assert not lit.exact and _calls(lit.text) == {"FSDPStrategy"}
    assert _calls(export_plan(plan, to="lightning").text) == _FSDP2_CALLS
    _yaml_lines_ok(export_plan(plan, to="accelerate").text)


def test_legitimate_plan_exports_unchanged(gpt_tiny):
    model, _, graph = gpt_tiny
    spec = make_plan(graph, MESH2, list(graph.blocks))
    plan = WrapPlan(spec=spec, model=model_fingerprint(model))
    acc = export_plan(plan, to="accelerate")
    assert "  fsdp_transformer_layer_cls_to_wrap: GPTBlock\n" in acc.text
    assert "mixed_precision: 'no'\n" in acc.text
    assert f"# written by `wrapopt export`" in acc.text and "for GPT on 2 ranks" in acc.text
    lit = export_plan(plan, to="lightning-fsdp1")
    assert "from wrapopt.models.zoo import GPTBlock\n" in lit.text and "auto_wrap_policy={GPTBlock}" in lit.text
    assert _calls(lit.text) == {"FSDPStrategy"}
