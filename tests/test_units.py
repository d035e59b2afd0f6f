"""units.py: ``validate_plan`` names the module, the unit and the rule a plan breaks."""

from __future__ import annotations

import pytest

from wrapopt.errors import PlanError
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec
from wrapopt.units import validate_plan

MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


def test_validate_rejects_unknown_module(gpt_tiny):
    _, _, graph = gpt_tiny
    spec = PlanSpec(units=(UnitSpec(("layers.7",)), UnitSpec((ROOT,), False)), mesh=MESH)
    with pytest.raises(PlanError, match=r"layers\.7"):
        validate_plan(graph, spec)


def test_validate_rejects_module_listed_twice(gpt_tiny):
    _, _, graph = gpt_tiny
    spec = PlanSpec(units=(UnitSpec(("layers.0",)), UnitSpec(("layers.1", "layers.0")), UnitSpec((ROOT,), False)),
                    mesh=MESH)
    with pytest.raises(PlanError, match=r"'layers\.0'"):
        validate_plan(graph, spec)


def test_validate_rejects_split_tied_group(gpt_tiny):
    _, _, graph = gpt_tiny
    spec = PlanSpec(units=(UnitSpec(("wte",)), UnitSpec((ROOT,), False)), mesh=MESH)
    with pytest.raises(PlanError) as exc:
        validate_plan(graph, spec)
    assert "wte.weight" in str(exc.value) and "lm_head.weight" in str(exc.value)


def test_validate_accepts_tied_group_in_one_unit(gpt_tiny):
    _, _, graph = gpt_tiny
    validate_plan(graph, PlanSpec(units=(UnitSpec(("wte", "lm_head")), UnitSpec((ROOT,), False)), mesh=MESH))


def test_validate_rejects_root_not_last(gpt_tiny):
    _, _, graph = gpt_tiny
    spec = PlanSpec(units=(UnitSpec((ROOT,), False), UnitSpec(("layers.0",))), mesh=MESH)
    with pytest.raises(PlanError, match="root"):
        validate_plan(graph, spec)


def test_validate_rejects_nested_modules_in_one_unit(gpt_tiny):
    _, _, graph = gpt_tiny
    spec = PlanSpec(units=(UnitSpec(("layers.0", "layers.0.mlp")), UnitSpec((ROOT,), False)), mesh=MESH)
    with pytest.raises(PlanError, match=r"layers\.0\.mlp"):
        validate_plan(graph, spec)


def test_validate_rejects_hpz_not_dividing_shard_group(gpt_tiny):
    _, _, graph = gpt_tiny
    spec = PlanSpec(units=(UnitSpec(("layers.0",), 3), UnitSpec((ROOT,), False)), mesh=MESH)
    with pytest.raises(PlanError, match="reshard_after_forward=3"):
        validate_plan(graph, spec)


