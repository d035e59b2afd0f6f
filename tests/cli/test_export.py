"""``wrapopt export PLAN --to accelerate|lightning`` (cli/export.py)."""

from __future__ import annotations

import argparse
import json

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
    assert _cli(["export", str(lossy), "--to", "lightning"]) == 0
    cap = capsys.readouterr()
    assert "auto_wrap_policy={GPTBlock}" in cap.out and "does not reproduce the plan exactly" in cap.err
    assert _cli(["export", str(lossy), "--to", "accelerate", "--strict", "--out", str(tmp_path / "no.yaml")]) == 1
    assert not (tmp_path / "no.yaml").exists()
    assert _cli(["export", str(lossy), "--to", "accelerate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["exact"] is False and data["settings"]["fsdp_config"]["fsdp_version"] == 2
