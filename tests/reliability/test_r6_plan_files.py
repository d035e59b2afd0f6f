"""Plan files checked in one place (issue 51, "what the sweep found"): a plan whose batch split
no longer multiplies out to its global batch, that names a module its model lacks or one module
twice, or that was made for another model or world size is refused by ``show``, ``estimate``,
``search --current``, ``export`` and ``apply`` with one line naming the file and the field
(See [Note: one plan check] in wrapopt/plan/check.py). Files of stated numbers refuse unknown
or misspelt keys and impossible counts; a world smaller than its node gets a note, not an error."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Callable

import pytest

from tests.reliability.common import ERROR, assert_api_refuses, assert_cli_refuses, run_cli
from wrapopt.errors import PlanError, PlanMismatchError, ProfileError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.hardware.catalog import GPU_TEMPLATE
from wrapopt.hardware.presets import NETWORK_TEMPLATE, TEMPLATE
from wrapopt.plan.check import check_plan, check_plan_fields
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec, PipelineSpec, PlanSpec
from wrapopt.train import TrainConfig

GPT = ["zoo:gpt-tiny"]
MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
TRAIN = TrainConfig(micro_batch=2, grad_accumulation=2, global_batch=8)  # 2 x 2 x 2 ranks


@pytest.fixture(scope="module")
def good(gpt_tiny) -> dict[str, Any]:
    """A per-block plan for gpt-tiny on 2 ranks at global batch 8 (micro-batch 2 x accumulation 2)."""
    model, _inputs, graph = gpt_tiny
    spec = baselines(graph, MESH)["per-block"]
    return WrapPlan(spec=spec, model=model_fingerprint(model), train=TRAIN).to_json()


def _write(tmp_path, data: dict[str, Any], change: Callable[[dict], None] | None = None,
           name: str = "plan.json") -> str:
    data = json.loads(json.dumps(data))
    if change is not None:
        change(data)
    path = os.path.join(tmp_path, name)
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def _set(dotted: str, value: Any) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        *path, last = dotted.split(".")
        for part in path:
            d = d[int(part)] if isinstance(d, list) else d[part]
        d[int(last) if isinstance(d, list) else last] = value
    return change


def case(given: Any, *fragments: str, id: str) -> Any:  # noqa: A002 (pytest's word)
    """One row: the change to a good file and the fragments the one line must hold."""
    return pytest.param(given, fragments, id=id)


BAD_PLANS = [
    case(_set("train.global_batch", 16), "train.global_batch", "is 16", "train.micro_batch 2", "is 8",
         id="split-not-global-batch"),
    case(_set("train.micro_batch", 1), "train.global_batch", "is 8", "train.micro_batch 1", "is 4",
         id="micro-batch-edited"),
    case(_set("units.0.modules", ["layers.9"]), "units[0].modules", "'layers.9'", "model.module_classes",
         id="module-the-model-lacks"),
    case(_set("units.1.modules", ["layers.0"]), "'layers.0'", "units 0 and 1", id="module-twice"),
]


@pytest.mark.parametrize("change, fragments", BAD_PLANS)
def test_show_refuses_a_bad_plan(good, change, fragments, tmp_path, capsys):
    path = _write(tmp_path, good, change)
    assert_cli_refuses(["show", path], ERROR, (path, *fragments), capsys)
    assert_api_refuses(lambda: WrapPlan.load(path), PlanError, (path, *fragments))


def test_show_prints_the_good_plan(good, tmp_path, capsys):
    path = _write(tmp_path, good)
    code, err = run_cli(["show", path], capsys)
    assert code == 0, err


def test_estimate_current_and_export_refuse_the_same_split(good, tmp_path, capsys):
    """One check, one message, whatever reads the file."""
    path = _write(tmp_path, good, _set("train.global_batch", 16))
    frags = (path, "field 'train.global_batch' is 16", "is 8")
    assert_cli_refuses(["estimate", *GPT, "--plan", path], ERROR, frags, capsys)
    assert_cli_refuses(["search", *GPT, "--world-size", "2", "--current", path], ERROR, frags, capsys)
    assert_cli_refuses(["export", path, "--to", "accelerate"], ERROR, frags, capsys)


def test_current_refuses_another_world_size_and_model(good, tmp_path, capsys):
    """``--current FILE`` is checked as ``estimate --plan FILE`` is: the mesh and the model."""
    path = _write(tmp_path, good)
    assert_cli_refuses(["search", *GPT, "--world-size", "4", "--current", path], ERROR,
                       (path, "field 'mesh.world_size' is 2", "--world-size is 4"), capsys)
    assert_cli_refuses(["estimate", *GPT, "--world-size", "4", "--plan", path], ERROR,
                       (path, "field 'mesh.world_size' is 2", "--world-size is 4"), capsys)
    assert_cli_refuses(["estimate", *GPT, "--gpus-per-node", "1", "--plan", path], ERROR,
                       (path, "field 'mesh.ranks_per_node' is 2", "--gpus-per-node is 1"), capsys)
    code, err = run_cli(["estimate", *GPT, "--world-size", "2", "--gpus-per-node", "8", "--plan", path], capsys)
    assert code == 0, err  # 2 ranks on an 8-GPU node: the plan's 2 per node
    other = _write(tmp_path, good, lambda d: d["model"]["params"]["wte.weight"].update(shape=[7, 7]),
                   name="other.json")  # a plan for a model with another embedding
    for argv in (["search", *GPT, "--world-size", "2", "--current", other], ["estimate", *GPT, "--plan", other]):
        assert_cli_refuses(argv, ERROR, (other, "wte.weight [7, 7]->"), capsys)


def test_apply_refuses_a_split_made_in_memory(gpt_tiny):
    """``apply`` (and so ``train_step``, which trusts the plan's accumulation) runs the same check
    before any process group is needed."""
    model, _inputs, graph = gpt_tiny
    spec = baselines(graph, MESH)["per-block"]
    plan = WrapPlan(spec=spec, model=model_fingerprint(model), train=replace(TRAIN, grad_accumulation=3))
    assert_api_refuses(lambda: plan.apply(model), PlanError,
                       ("the plan: field 'train.global_batch' is 8", "train.grad_accumulation 3", "is 12"))
    other = WrapPlan(spec=spec, model={**model_fingerprint(model), "params": {}}, train=TRAIN, source="p.json")
    assert_api_refuses(lambda: check_plan(other, model=model), PlanMismatchError, ("p.json: ", "parameters only"))


def test_pipeline_split_counts_its_micro_batches(gpt_tiny):
    """A pipeline plan's global batch is micro_batch x microbatches x data-parallel ranks."""
    _model, _inputs, graph = gpt_tiny
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, pp_size=2)
    units = baselines(graph, MeshSpec(world_size=2, ranks_per_node=2, shard_size=2))["per-block"].units
    pipe = PipelineSpec(stages=(("layers.0", "layers.1"), ("layers.2", "layers.3")), schedule="1F1B", microbatches=4)
    spec = PlanSpec(units, mesh, pipeline=pipe)
    check_plan_fields(spec, {}, TrainConfig(micro_batch=1, global_batch=8), source="pp.json")  # 1 x 4 x 2
    assert_api_refuses(lambda: check_plan_fields(spec, {}, TrainConfig(micro_batch=2, global_batch=8),
                                                 source="pp.json"),
                       PlanError, ("pp.json", "pipeline.microbatches 4", "is 16"))


# --- files of stated numbers: --gpu, --network, --fabric -------------------------------------------

STATED = [
    case(("--gpu", GPU_TEMPLATE, _set("num_sms", 0)), "'num_sms'", "must be positive", id="gpu-0-sms"),
    case(("--gpu", GPU_TEMPLATE, _set("num_sms", 13.5)), "'num_sms'", "whole number", "13.5", id="gpu-fraction-sms"),
    case(("--gpu", GPU_TEMPLATE, lambda d: d.update(num_sm=d.pop("num_sms"))), "'num_sm'",
         "did you mean 'num_sms'?", id="gpu-misspelt-key"),
    case(("--gpu", GPU_TEMPLATE, _set("colour", "green")), "'colour' is not a field", "num_sms",
         id="gpu-unknown-key"),
    case(("--network", NETWORK_TEMPLATE, _set("gpus_per_node", 3)), "'gpus_per_node' is 3", "8 ranks on a node",
         "--gpus-per-node 3", id="network-3-per-node"),
    case(("--network", NETWORK_TEMPLATE, _set("inter_node.latency", 1e-5)), "inter_node", "'latency'",
         "did you mean 'latency_s'?", id="network-misspelt-link-key"),
    case(("--fabric", TEMPLATE, _set("achievable_fractoin", 0.5)), "did you mean 'achievable_fraction'?",
         id="cluster-misspelt-key"),
    case(("--fabric", TEMPLATE, _set("num_sms", 0.5)), "'num_sms'", "whole number", id="cluster-fraction-sms"),
]


@pytest.mark.parametrize("given, fragments", STATED)
def test_stated_files_refuse_unknown_keys_and_impossible_counts(given, fragments, tmp_path, capsys):
    flag, template, change = given
    path = _write(tmp_path, template, change, name="stated.json")
    assert_cli_refuses(["estimate", *GPT, "--world-size", "16", flag, path], ERROR, (path, *fragments), capsys)


def test_stated_counts_that_are_whole_are_used(tmp_path):
    """A whole SM count is read (not replaced by the default); a network of 8 per node fits 8."""
    from wrapopt.hardware.catalog import gpu_from_json
    from wrapopt.hardware.presets import analytical_from_json

    assert gpu_from_json({**GPU_TEMPLATE, "num_sms": 78}, source="g.json").datasheet.num_sms == 78
    fab = analytical_from_json({**TEMPLATE, "num_sms": 78}, source="c.json", world_size=16, ranks_per_node=8)
    assert fab.meta["compute"]["num_sms"] == 78
    net = analytical_from_json(NETWORK_TEMPLATE, source="n.json", world_size=16, ranks_per_node=8)
    assert net.ranks_per_node == 8
    with pytest.raises(ProfileError, match="'gpus_per_node' is 8"):
        analytical_from_json(NETWORK_TEMPLATE, source="n.json", world_size=16, ranks_per_node=16)


def test_partial_node_is_a_note_not_an_error(capsys):
    """``--gpus-per-node 8 --world-size 2`` is ``torchrun --nproc-per-node 2`` on an 8-GPU node: legal,
    planned as one partial node, and said once (``estimate``: in its notes; ``search``: on stderr)."""
    note = "note: --world-size 2 is less than --gpus-per-node 8: planned as one partial node of 2 ranks"
    from wrapopt.cli.main import main

    assert main(["estimate", *GPT, "--world-size", "2", "--gpus-per-node", "8"]) == 0
    assert capsys.readouterr().out.count(note) == 1
    assert main(["search", *GPT, "--world-size", "2", "--gpus-per-node", "8", "--trials", "0"]) == 0
    assert capsys.readouterr().err.count(note) == 1
    assert main(["estimate", *GPT, "--world-size", "8", "--gpus-per-node", "8"]) == 0
    assert "partial node" not in capsys.readouterr().out
