"""evaluation/pictures.py: the demo's two pictures from a search on meta shapes, with
measured rows as the demo passes them (no ranks: the rows are made up here)."""

from __future__ import annotations

import json

import pytest

from tests.report.test_plots import png_size
from wrapopt.cost import Simulator
from wrapopt.evaluation.pictures import PICTURES, REFERENCE_BASELINE, pictures_json, write_pictures
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.search.driver import search_plan
from wrapopt.spec import MeshSpec

MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)


@pytest.fixture(scope="module")
def pics(gpt_tiny):
    _model, _inputs, graph = gpt_tiny
    sim = Simulator(graph, analytical_fabric(world_size=2, ranks_per_node=2), analytical_compute())
    result = search_plan(graph, sim, MESH, memory_budget=12 * 2**20)
    return json.loads(json.dumps(pictures_json(sim, result, result.best.plan))), result  # travels as JSON


def test_pictures_json_holds_both_timelines_and_every_scored_plan(pics):
    data, result = pics
    assert data["chosen"]["label"] == result.best.plan.label
    assert data["chosen"]["prediction"]["timeline"] and data["reference"]["prediction"]["timeline"]
    assert data["reference"]["label"] == REFERENCE_BASELINE != result.best.plan.label
    assert len(data["scored"]) == len(result.candidates)
    assert data["memory_budget"] == 12 * 2**20


def test_write_pictures_with_measured_rows(pics, tmp_path):
    pytest.importorskip("matplotlib")
    data, result = pics
    rows = [{"plan": "wrapopt:" + result.best.plan.label, "chosen": True}, {"plan": "per-block", "chosen": False},
            {"plan": "a plan only the bench ran", "chosen": False}]
    for row, s in zip(rows, (result.best, result.baselines["per-block"], result.baselines["no-shard"])):
        row.update(pred_step_s=s.estimate.step_s, pred_peak_bytes=s.estimate.peak_bytes,
                   meas_step_s=s.estimate.step_s * 1.2, meas_peak_bytes=s.estimate.peak_bytes)
    paths = write_pictures(tmp_path / "out", data, measured=rows, title="gpt-tiny on 2 ranks")
    assert [p.rsplit("/", 1)[1] for p in paths] == list(PICTURES)
    for p in paths:
        width, height = png_size(tmp_path / "out" / p.rsplit("/", 1)[1])
        assert width >= 800 and height >= 400
