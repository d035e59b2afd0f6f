"""Checks ``apply`` runs before any ``fully_shard`` (no process group needed): the plan rules
``estimate`` runs (``check_units``: See [Note: unit ownership] in wrapopt/units.py), refused
with the same message (issue 33)."""

from __future__ import annotations

import pytest

from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec
from wrapopt.units import validate_plan

MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
ROOT_UNIT = UnitSpec((ROOT,), False)


@pytest.mark.parametrize("units, words", [
    ((UnitSpec(("lm_head",)), ROOT_UNIT), "tied parameters wte.weight, lm_head.weight would land in different units"),
    ((UnitSpec(("layers.0",)), UnitSpec(("layers.0", "layers.1")), ROOT_UNIT),
     "module 'layers.0' is in units 0 and 1; each module may be wrapped once"),
    ((UnitSpec(("layers.0", "layers.0.attn")), ROOT_UNIT), "lists 'layers.0' and its descendant 'layers.0.attn'"),
    ((ROOT_UNIT, UnitSpec(("layers.0",))), "the last unit of a plan must be the root"),
])
def test_apply_refuses_what_estimate_refuses_with_the_same_message(gpt_tiny, units, words):
    model, _inputs, graph = gpt_tiny
    spec = PlanSpec(units, MESH)
    with pytest.raises(PlanError) as on_estimate:
        validate_plan(graph, spec)
    plan = WrapPlan(spec=spec, model=model_fingerprint(model))
    with pytest.raises(PlanError) as on_apply:  # no process group: it fails before any collective
        plan.apply(zoo.build("gpt-tiny", "meta")[0])
    assert str(on_apply.value) == str(on_estimate.value)
    assert words in str(on_apply.value) and "\n" not in str(on_apply.value)
