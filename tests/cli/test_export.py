"""``wrapopt export PLAN --to accelerate|lightning|lightning-fsdp1`` (cli/export.py)."""

from __future__ import annotations

import argparse
import json
import os

from tests.ranks import MESH2
from wrapopt.cli import export
from wrapopt.fingerprint import model_fingerprint
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import make_plan


def _plan(graph, model, modules, **kw) -> WrapPlan:
    mp = kw.pop("mixed_precision", None)
    spec = make_plan(graph, kw.pop("mesh", MESH2), modules, **kw)
    return WrapPlan(spec=spec, model=model_fingerprint(model), **({"mixed_precision": mp} if mp else {}))


def _cli(argv):
    parser = argparse.ArgumentParser(prog="wrapopt")
    export.add_parser(parser.add_subparsers(dest="command", required=True))
    return export.run(parser.parse_args(argv))


def test_export_command(gpt_tiny, tmp_path, capsys):
    model, _, graph = gpt_tiny
    exact, lossy = tmp_path / "exact.json", tmp_path / "lossy.json"
    _plan(graph, model, list(graph.blocks)).save(exact)
    _plan(graph, model, [("layers.0", "layers.1"), ("layers.2", "layers.3")]).save(lossy)
    assert _cli(["export", str(exact), "--to", "accelerate", "--out", str(tmp_path / "acc.yaml")]) == 0
    assert "fsdp_transformer_layer_cls_to_wrap: GPTBlock" in (tmp_path / "acc.yaml").read_text()
    capsys.readouterr()
    assert _cli(["export", str(lossy), "--to", "lightning-fsdp1"]) == 0
    cap = capsys.readouterr()
    assert "auto_wrap_policy={GPTBlock}" in cap.out and "does not reproduce the plan exactly" in cap.err
    for to in ("lightning", "lightning-fsdp2"):  # FSDP2: the plan itself, exact
        assert _cli(["export", str(lossy), "--to", to]) == 0
        cap = capsys.readouterr()
        assert "ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)" in cap.out
        assert f"PLAN_PATH = {os.path.relpath(lossy)!r}" in cap.out and not cap.err  # relative: beside the module
    assert _cli(["export", str(lossy), "--to", "accelerate", "--out", str(tmp_path / "lossy.yaml")]) == 0
    err = capsys.readouterr().err  # what the export loses: grouping, in the CLI's lines and in the file
    assert "become one unit per block" in err and "fewer, larger all-gathers" in err
    assert "#   - 2 grouped unit(s) of 2 blocks" in (tmp_path / "lossy.yaml").read_text()
    assert _cli(["export", str(lossy), "--to", "accelerate", "--strict", "--out", str(tmp_path / "no.yaml")]) == 1
    assert not (tmp_path / "no.yaml").exists()
    assert _cli(["export", str(lossy), "--to", "accelerate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["exact"] is False and data["settings"]["fsdp_config"]["fsdp_version"] == 2
