"""The ``wrapopt`` command line, called in-process through ``main(argv)``.

Library and user errors must give exit code 1 and one line on stderr. The
llama-7b searches run on meta shapes (about a second each); a module fixture
runs the JSON search once and the tests read its outputs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from wrapopt.cli.main import main
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import BASELINE_NAMES
from wrapopt.search.choose import STEP_ERROR

LLAMA_7B = ["zoo:llama-7b", "--world-size", "64", "--gpus-per-node", "8"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` with stdout and stderr captured (usable from module fixtures)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _one_line_error(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"wrapopt {command}: error: "), err
    return lines[0]


def _subprocess_env(repo_root: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def llama_search(tmp_path_factory):
    """``search zoo:llama-7b ... --json --out plan.json``: (stdout JSON, plan path)."""
    path = tmp_path_factory.mktemp("search") / "plan.json"
    rc, out, err = _run(["search", *LLAMA_7B, "--json", "--out", str(path)])
    assert rc == 0, err
    return json.loads(out), path


# --- trace -----------------------------------------------------------------------------------------


def test_trace_prints_tree(capsys):
    assert main(["trace", "zoo:gpt-tiny"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPT: 335,232 parameters")
    assert "GPTBlock" in out and "4 x GPTBlock" in out
    assert "wte.weight = lm_head.weight" in out
    assert "<root>" in out and "lm_head" in out


def test_trace_json(capsys):
    assert main(["trace", "zoo:gpt-tiny", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    model, _ = zoo.build("gpt-tiny", "meta")
    assert data["num_params"] == sum(p.numel() for p in model.parameters())
    assert [m["fqn"] for m in data["modules"]] == [n for n, _ in model.named_modules()]
    assert data["tied_groups"] == [["wte.weight", "lm_head.weight"]]
    assert data["block_chains"] == [[f"layers.{i}" for i in range(4)]]


def test_trace_callable_model(capsys):
    assert main(["trace", "tests.fixtures_models:make_mlp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("MLPStack: 3,760 parameters")
    assert "3 x MLPBlock" in out


def test_trace_callable_that_does_not_exist(capsys):
    assert main(["trace", "tests.fixtures_models:no_such_thing"]) == 1
    line = _one_line_error(capsys.readouterr().err, "trace")
    assert "no_such_thing" in line


def test_trace_hf_missing_file(capsys, tmp_path):
    missing = tmp_path / "nope" / "config.json"
    assert main(["trace", f"hf:{missing}"]) == 1
    line = _one_line_error(capsys.readouterr().err, "trace")
    assert str(missing) in line


def test_trace_hf_config_file(capsys, tmp_path):
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128,
                               "n_positions": 16}))
    assert main(["trace", f"hf:{cfg}", "--seq", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_class"] == "GPT2LMHeadModel"
    assert ["transformer.wte.weight", "lm_head.weight"] in data["tied_groups"]
    assert len(data["block_chains"]) == 1 and len(data["block_chains"][0]) == 2


def test_unknown_model_spec_is_an_error(capsys):
    assert main(["trace", "gpt-tiny"]) == 1  # no zoo: prefix
    assert "zoo:NAME" in _one_line_error(capsys.readouterr().err, "trace")


# --- search ---------------------------------------------------------------------------------------


def test_search_json(llama_search):
    data, _ = llama_search
    assert data["format"] == "wrapopt.plan/1"
    assert data["units"] and data["units"][-1]["modules"] == [""]
    covered = {m for u in data["units"] for m in u["modules"]}
    assert covered <= {""} | {f"layers.{i}" for i in range(32)} | {"embed_tokens", "norm", "lm_head"}
    pred = data["prediction"]
    assert pred["step_s"] > 0 and pred["peak_bytes"] > 0 and pred["exposed_comm_s"] >= 0
    assert set(data["baselines"]) == set(BASELINE_NAMES)
    assert {"per-block", "per-block,ckpt", "size-1e8", "every-leaf", "root-only", "no-shard"} == set(data["baselines"])
    for name, b in data["baselines"].items():
        assert b["step_s"] > 0 and b["peak_bytes"] > 0 and b["num_units"] >= 1, name
    assert data["fabric"]["kind"] == "analytical"
    assert data["mesh"]["world_size"] == 64 and data["mesh"]["ranks_per_node"] == 8
    assert data["model"]["class"] == "Llama" and data["model"]["num_params"] == 6_738_415_616
    assert "params" not in data["model"]  # the per-parameter fingerprint stays in the file


def test_search_best_is_no_worse_than_baselines(llama_search):
    data, _ = llama_search
    # No slower than a fitting baseline by more than the simulator's error: See [Note: plans within the error].
    best = data["prediction"]["step_s"]
    assert all(best <= b["step_s"] * (1 + STEP_ERROR) for b in data["baselines"].values() if b["fits"])
    assert data["search"]["why"] and data["search"]["units_summary"].endswith("root (keep)")


def test_search_out_writes_loadable_plan(llama_search):
    data, path = llama_search
    plan = WrapPlan.load(path)
    assert [list(u.modules) for u in plan.units] == [u["modules"] for u in data["units"]]
    assert plan.mesh.world_size == 64
    model, _ = zoo.build("llama-7b")
    plan.check_model(model)
    with open(path, encoding="utf-8") as f:
        assert "params" in json.load(f)["model"]


def test_search_text_marks_analytical(capsys, tmp_path):
    out_path = tmp_path / "p.json"
    assert main(["search", *LLAMA_7B, "--trials", "0", "--out", str(out_path)]) == 0  # the DP, not the study
    out = capsys.readouterr().out
    assert "ANALYTICAL" in out
    for name in BASELINE_NAMES:
        assert name in out
    assert f"wrote {out_path}" in out and out_path.exists()


@pytest.mark.parametrize("memory, shown", [("80GiB", "80.00 GiB"), ("80GB", "74.51 GiB")])
def test_search_memory_budget_formats(capsys, memory, shown):
    assert main(["search", *LLAMA_7B, "--memory", memory, "--trials", "0"]) == 0
    assert f"memory budget: {shown} per rank" in capsys.readouterr().out


def test_search_memory_unreadable(capsys):
    assert main(["search", *LLAMA_7B, "--memory", "lots"]) == 1
    captured = capsys.readouterr()
    line = _one_line_error(captured.err, "search")
    assert "'lots'" in line and "80GiB" in line
    assert captured.out == ""


def test_search_memory_too_small_gives_smallest_peak(capsys):
    assert main(["search", *LLAMA_7B, "--memory", "1MB"]) == 1
    # The error is one line; the remedies priced on the plan follow it, indented
    # (See [Note: computed remedies] in search/remedies.py).
    first, *advice = capsys.readouterr().err.strip().splitlines()
    line = _one_line_error(first, "search")
    assert "smallest predicted peak is" in line
    assert "GiB" in line.split("smallest predicted peak is", 1)[1]
    assert advice and advice[0].startswith("Remedies") and all(a.startswith("  ") for a in advice[1:]), advice


def test_search_unknown_zoo_name_lists_zoo(capsys):
    assert main(["search", "zoo:nope", "--world-size", "8"]) == 1
    line = _one_line_error(capsys.readouterr().err, "search")
    assert "'nope'" in line
    for name in zoo.ZOO:
        assert name in line


def test_search_world_size_not_multiple_of_node(capsys):
    assert main(["search", "zoo:gpt-tiny", "--world-size", "12", "--gpus-per-node", "8"]) == 1
    line = _one_line_error(capsys.readouterr().err, "search")
    assert "12" in line and "8" in line


def test_search_out_to_a_directory_fails_early(capsys, tmp_path):
    assert main(["search", "zoo:gpt-tiny", "--world-size", "8", "--out", str(tmp_path)]) == 1
    assert str(tmp_path) in _one_line_error(capsys.readouterr().err, "search")


def test_search_needs_world_size(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["search", "zoo:gpt-tiny"])
    assert exc.value.code == 2
    assert "--world-size" in capsys.readouterr().err


# --- show ------------------------------------------------------------------------------------------


def test_show_prints_plan(capsys, llama_search):
    data, path = llama_search
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Llama" in out and "6,738,415,616" in out
    assert "ANALYTICAL" in out
    assert f"{len(data['units'])} units" in out
    for name in BASELINE_NAMES:
        assert name in out


def test_show_json_echoes_file(capsys, llama_search):
    _, path = llama_search
    assert main(["show", str(path), "--json"]) == 0
    echoed = json.loads(capsys.readouterr().out)
    with open(path, encoding="utf-8") as f:
        assert echoed == json.load(f)


def test_show_timeline_png(capsys, llama_search, tmp_path):
    pytest.importorskip("matplotlib")
    _, path = llama_search
    png = tmp_path / "timeline.png"
    assert main(["show", str(path), "--timeline", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000


def test_show_missing_file(capsys, tmp_path):
    missing = tmp_path / "none.json"
    assert main(["show", str(missing)]) == 1
    assert str(missing) in _one_line_error(capsys.readouterr().err, "show")


def test_show_malformed_plan_names_field(capsys, llama_search, tmp_path):
    data, path = llama_search
    with open(path, encoding="utf-8") as f:
        plan = json.load(f)
    plan["units"][0]["reshard_after_forward"] = "yes"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(plan))
    assert main(["show", str(bad)]) == 1
    line = _one_line_error(capsys.readouterr().err, "show")
    assert str(bad) in line and "units[0].reshard_after_forward" in line


def test_show_non_string_format_is_an_error(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 5}))
    assert main(["show", str(bad)]) == 1
    assert str(bad) in _one_line_error(capsys.readouterr().err, "show")


# --- as a program ------------------------------------------------------------------------------------


def test_module_help_runs(repo_root):
    proc = subprocess.run([sys.executable, "-m", "wrapopt.cli", "--help"], cwd=repo_root,
                          env=_subprocess_env(repo_root), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("trace", "search", "show", "profile-fabric", "demo"):
        assert command in proc.stdout


_RSS_SCRIPT = """
import resource, sys
from wrapopt.cli.main import main
rc = main(["search", "zoo:llama-7b", "--world-size", "64", "--gpus-per-node", "8", "--out", sys.argv[1]])
print("MAXRSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
sys.exit(rc)
"""


def test_search_llama_7b_allocates_no_weights(repo_root, tmp_path):
    # 6.7e9 bf16 parameters would be 12.5 GiB; planning on meta must stay far below.
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "p.json")], cwd=repo_root,
                          env=_subprocess_env(repo_root), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rss_kb = int(proc.stderr.split("MAXRSS_KB", 1)[1].split()[0])  # Linux: kilobytes
    assert 0 < rss_kb < 3 * 2**20, f"max RSS {rss_kb / 2**20:.2f} GiB"
    assert (tmp_path / "p.json").exists()


def test_search_tp_auto_reports_the_2d_rows(capsys):
    assert main(["search", "zoo:llama-tiny", "--world-size", "16", "--gpus-per-node", "8", "--tp", "auto",
                 "--trials", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["search"]
    rows = {r["row"]: r for r in out["tp_rows"]}
    assert set(rows) == {"best 1-D", "best tp2", "TorchTitan default (tp2, one unit per block, checkpointed)"}
    assert rows["best tp2"]["tp_size"] == 2 and rows["best 1-D"]["tp_size"] == 1
    assert out["tp_chosen"] in (1, 2)


def test_search_tp_bad_degree_is_one_line(capsys):
    assert main(["search", "zoo:llama-tiny", "--world-size", "16", "--gpus-per-node", "8", "--tp", "4",
                 "--trials", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert any("tensor-parallel degree 4 does not divide the heads of layers.0.self_attn" in line for line in err)


def test_a_2d_plan_file_is_shown_and_estimated(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", "zoo:llama-tiny", "--world-size", "16", "--gpus-per-node", "8", "--tp", "2",
                 "--trials", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "tensor parallel 2 inside the node" in shown
    assert "tensor parallel (builtin) in every LlamaBlock: colwise mlp.gate_proj" in shown
    assert main(["estimate", "zoo:llama-tiny", "--plan", str(out), "--world-size", "16", "--gpus-per-node", "8"]) == 0
    assert ", tensor parallel 2   fabric:" in capsys.readouterr().out


def test_search_takes_a_user_tp_plan(tmp_path, capsys):
    plan = tmp_path / "tp.json"
    plan.write_text(json.dumps({"layers": {"GPTBlock": {"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}}}))
    out = tmp_path / "plan.json"
    args = ["search", "zoo:gpt-tiny", "--world-size", "16", "--gpus-per-node", "8", "--tp", "2",
            "--tp-plan", str(plan), "--trials", "0", "--out", str(out)]
    capsys.readouterr()
    assert main(args) == 1  # sequence parallel (the default) has no place for the attention the plan leaves whole
    assert ("layers.0.attn (Attention) is neither a norm of the block nor inside the attention or MLP that "
            "tensor parallelism splits" in capsys.readouterr().err)
    assert main([*args, "--no-sequence-parallel"]) == 0
    saved = json.loads(out.read_text())
    assert saved["tp"] == {"source": "user", "layers": {"GPTBlock": {"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}},
                           "sequence_parallel": False, "loss_parallel": True, "async_tp": False}
    plan.write_text(json.dumps({"layers": {"GPTBlock": {"mlp.fc1": "sideways"}}}))
    capsys.readouterr()
    assert main(["search", "zoo:gpt-tiny", "--world-size", "16", "--tp", "2", "--tp-plan", str(plan)]) == 1
    assert "tp.layers.GPTBlock.mlp.fc1' style must be colwise or rowwise" in capsys.readouterr().err


def test_a_negative_memory_reaches_its_own_message(capsys):
    """argparse reads ``--memory -10GiB`` as a missing value; the value's own check says what is wrong."""
    assert main(["search", "zoo:gpt-tiny", "--world-size", "8", "--memory", "-10GiB"]) == 1
    err = capsys.readouterr().err
    assert "memory_budget (--memory) '-10GiB' is not a memory size" in err and "expected one argument" not in err
