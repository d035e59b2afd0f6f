"""3-D plans in the plan file: the mesh's pipeline axis and the stages round-trip, a broken
pipeline field is named, and the exports that cannot run a pipeline refuse it."""

from __future__ import annotations

import copy
import json

import pytest

from tests.plan.common import load_data
from wrapopt.errors import OptionError, PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop.export import export_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import ROOT, MeshSpec, PipelineSpec, PlanSpec, UnitSpec


@pytest.fixture(scope="module")
def pp_plan(llama_tiny) -> WrapPlan:
    model, _inputs, graph = llama_tiny
    blocks = graph.blocks
    stages = (("embed_tokens", *blocks[:3]), (*blocks[3:], "norm", "lm_head"))
    spec = PlanSpec(tuple(UnitSpec((b,)) for b in blocks) + (UnitSpec((ROOT,), False),),
                    MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, pp_size=2),
                    pipeline=PipelineSpec(stages=stages, schedule="1F1B", microbatches=4))
    return WrapPlan(spec=spec, model=model_fingerprint(model))



def test_a_pipeline_plan_round_trips(pp_plan, tmp_path):
    path = tmp_path / "pp.json"
    pp_plan.save(path)
    raw = json.loads(path.read_text())
    assert raw["mesh"]["pp_size"] == 2 and raw["mesh"]["axis_names"] == ["pp", "shard"]
    assert raw["pipeline"]["microbatches"] == 4 and raw["pipeline"]["stages"][0][0] == "embed_tokens"
    back = WrapPlan.load(path)
    assert back.spec == pp_plan.spec and back.to_json() == pp_plan.to_json()


def test_the_mesh_axes_of_a_3d_mesh():
    mesh = MeshSpec(world_size=1024, ranks_per_node=8, shard_size=16, tp_size=8, pp_size=8)
    assert mesh.shape == (8, 16, 8) and mesh.axis_names == ("pp", "shard", "tp")
    assert mesh.dp_size == 16 and mesh.stages_cross_nodes
    assert mesh.stage_mesh() == MeshSpec(world_size=128, ranks_per_node=8, shard_size=16, tp_size=8)
    assert MeshSpec(world_size=128, ranks_per_node=8, shard_size=16, tp_size=8).with_pp(8) == mesh
    small = MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, pp_size=2)
    assert not small.stages_cross_nodes and small.stage_mesh().ranks_per_node == 2


@pytest.mark.parametrize("change, field, words", [
    (lambda d: d.pop("pipeline"), "pipeline", "mesh.pp_size 2 needs its stages"),
    (lambda d: d["pipeline"].update(schedule="ZeroBubble"), "pipeline", "unknown pipeline schedule 'ZeroBubble'"),
    (lambda d: d["pipeline"].update(microbatches=0), "pipeline.microbatches", "positive int"),
    (lambda d: d["pipeline"].update(stages=[["a", "b"]]), "pipeline", "at least 2 stages"),
    (lambda d: d["pipeline"].update(stages=[["a"], ["b"], ["c"]]), "pipeline.stages", "not a multiple of"),
    (lambda d: d["mesh"].update(pp_size=1, shape=[2, 2], axis_names=["replicate", "shard"]), "pipeline",
     "mesh.pp_size is 1"),
    (lambda d: d["mesh"].update(pp_size=3), "mesh", "pipeline degree 3"),
])
def test_pipeline_field_errors_name_the_file_and_the_field(pp_plan, tmp_path, change, field, words):
    data = copy.deepcopy(pp_plan.to_json())
    change(data)
    with pytest.raises(PlanError) as exc:
        load_data(tmp_path, data)
    msg = str(exc.value)
    assert str(tmp_path / "plan.json") in msg and field in msg and words in msg, msg


def test_a_plan_needs_a_pipeline_exactly_on_a_pipeline_mesh(pp_plan):
    with pytest.raises(ValueError, match="needs a PipelineSpec"):
        PlanSpec(pp_plan.spec.units, pp_plan.spec.mesh)
    with pytest.raises(OptionError, match="do not share out over 2 pipeline ranks"):
        PlanSpec(pp_plan.spec.units, pp_plan.spec.mesh,
                 pipeline=PipelineSpec(stages=(("a",), ("b",), ("c",)), microbatches=2))


def test_fsdp1_and_the_exports_refuse_a_pipeline_plan(pp_plan):
    with pytest.raises(PlanError, match="FSDP1 export does not support pipeline parallelism"):
        pp_plan.to_fsdp1_policy()
    for target in ("accelerate", "lightning", "lightning-fsdp1"):
        with pytest.raises(PlanError, match=f"cannot export to {target}"):
            export_plan(pp_plan, to=target)
