"""``wrapopt estimate --tp N`` and ``--checkpoint selective-op`` (search/given.py): a baseline
scored at a tensor-parallel degree as the search scores it, the checkpointing modes, and the
refusals, each one line."""

from __future__ import annotations

import json

import pytest

from wrapopt.cli.main import main
from wrapopt.fingerprint import model_fingerprint
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import make_plan
from wrapopt.spec import MeshSpec

ARGS = ["estimate", "zoo:llama-tiny", "--world-size", "8", "--gpus-per-node", "4", "--fabric", "a100+ib200"]


def _estimate(capsys, *extra: str) -> dict:
    assert main([*ARGS, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_tp_is_scored_as_the_search_scores_it(capsys):
    """The per-block baseline at tp 2, every block checkpointed, is the search's TorchTitan row."""
    search = ["search", *ARGS[1:], "--tp", "2", "--trials", "0", "--json"]
    assert main(search) == 0
    rows = json.loads(capsys.readouterr().out)["search"]["tp_rows"]
    titan = next(r for r in rows if r["row"].startswith("TorchTitan default"))
    est = _estimate(capsys, "--tp", "2", "--checkpoint", "blocks")
    assert est["mesh"]["tp_size"] == 2 and est["mesh"]["shard_size"] == titan["shard_size"] == 4
    assert est["step_s"] == pytest.approx(titan["step_s"], rel=1e-9)
    assert est["peak_bytes"] == titan["peak_bytes"]


def test_selective_op_sits_between_none_and_full(capsys):
    acts = {}
    for mode in ("none", "selective-op", "full"):
        e = _estimate(capsys, "--tp", "2", "--checkpoint", mode)
        acts[mode] = dict(e["peak_breakdown"])["activations"]
        assert e["plan"] == "per-block + tp2" and e["num_units"] == 7
    assert acts["full"] < acts["selective-op"] < acts["none"]


def test_bad_tp_is_one_line(capsys, tmp_path, llama_tiny):
    for extra, words in ((["--tp", "3"], "--tp 3 does not divide the 4 GPUs per node"),
                         (["--tp", "2", "--plan", "no-shard"], "a plan that does not shard has no data-parallel mesh"),
                         (["--checkpoint", "all"], "invalid choice: 'all'")):
        with pytest.raises(SystemExit) if extra[0] == "--checkpoint" else _nothing():
            assert main([*ARGS, *extra]) == 1
        err = capsys.readouterr().err
        assert words in err and err.strip().count("\n") <= 1, err
    plan = tmp_path / "p.json"  # a 1-D plan file
    model, _inputs, graph = llama_tiny
    WrapPlan(spec=make_plan(graph, MeshSpec(world_size=8, ranks_per_node=4, shard_size=8), list(graph.blocks)),
             model=model_fingerprint(model)).save(str(plan))
    assert main([*ARGS, "--plan", str(plan), "--tp", "2"]) == 1
    assert "the plan file is for tensor-parallel degree 1, --tp says 2" in capsys.readouterr().err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
