"""Broken and hostile files given on the command line: stated-number fabrics, measured fabric
profiles, compute profiles, plan files and Hugging Face configs. Each gives one line naming
the file and the field (with its unit for numbers), exit 1, no traceback (issue 33).

Each case is a change to a good file (``_set``, ``_drop``) or the raw text of a broken one."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Callable

import pytest

from tests.reliability.common import ERROR, assert_cli_refuses, case, run_cli
from wrapopt.hardware.presets import TEMPLATE, analytical_compute, analytical_fabric

GPT = ["zoo:gpt-tiny"]


def _set(dotted: str, value: Any) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        *path, last = dotted.split(".")
        for part in path:
            d = d[int(part)] if isinstance(d, list) else d[part]
        d[int(last) if isinstance(d, list) else last] = value
    return change


def _drop(key: str) -> Callable[[dict], None]:
    return lambda d: d.pop(key)


def _write(tmp_path, good: dict, change: Callable[[dict], None] | str, name: str = "file.json") -> str:
    """``good`` changed by ``change``, or the text ``change``, written to ``tmp_path/name``."""
    path = os.path.join(tmp_path, name)
    if isinstance(change, str):
        text = change
    else:
        data = copy.deepcopy(good)
        change(data)
        text = json.dumps(data)
    with open(path, "w") as f:
        f.write(text)
    return path


# --- stated numbers (`wrapopt fabric --template`), given to --fabric ---------------------------------

STATED = [
    case(_set("gpus_per_node", 3), ["--world-size", "16"], "'gpus_per_node' is 3", "8 ranks on a node",
         "--gpus-per-node 3", id="gpus-per-node-below-mesh"),
    case(_set("gpus_per_node", 0), ["--world-size", "8"], "'gpus_per_node' (GPUs)", "must be positive",
         id="gpus-per-node-0"),
    case(_set("gpus_per_node", "8"), ["--world-size", "8"], "'gpus_per_node' (GPUs) must be a number",
         id="gpus-per-node-text"),
    case(_set("format", "wrapopt.analytical/2"), ["--world-size", "8"], "'wrapopt.analytical/2'",
         "reads stated numbers in format 'wrapopt.analytical/1'", id="future-format"),
    case(_set("intra_node.latency_s", -1), ["--world-size", "8"], "intra_node", "'latency_s' (seconds",
         "at least 0", id="negative-latency"),
    case(_set("inter_node.bandwidth_bytes_per_s", 0), ["--world-size", "8"],
         "'bandwidth_bytes_per_s' (bytes/s", "positive", id="zero-bandwidth"),
    case(_drop("memory_capacity_bytes"), ["--world-size", "8"], "missing field 'memory_capacity_bytes' (bytes)",
         id="missing-capacity"),
    case(_set("memory_capacity_bytes", "80GiB"), ["--world-size", "8"], "'memory_capacity_bytes' (bytes) must be",
         id="capacity-as-text"),
    case(_set("memory_bandwidth_bytes_per_s", float("nan")), ["--world-size", "8"],
         "'memory_bandwidth_bytes_per_s'", id="nan-bandwidth"),
    case(_set("achievable_fraction", 2), ["--world-size", "8"], "'achievable_fraction'", "(0, 1]",
         id="fraction-above-1"),
    case(_set("peak_flops_per_s.bfloat16", -1), ["--world-size", "8"], "'bfloat16'", id="negative-peak"),
    case(_set("peak_flops_per_s", {"int8": 1e15}), ["--world-size", "8"], "peak_flops_per_s.int8", id="peak-dtype"),
    case("{\"format\": \"wrapopt.analytical/1\", ", ["--world-size", "8"], "file.json", id="truncated"),
]


@pytest.mark.parametrize("change, argv, fragments", STATED)
def test_stated_fabric_files(change, argv, fragments, tmp_path, capsys):
    path = _write(tmp_path, TEMPLATE, change)
    assert_cli_refuses(["estimate", *GPT, "--fabric", path, *argv], ERROR, (path, *fragments), capsys)


def test_stated_future_format_through_fabric_and_show(tmp_path, capsys):
    path = _write(tmp_path, TEMPLATE, _set("format", "wrapopt.analytical/2"))
    for argv in (["fabric", path], ["show", path]):
        assert_cli_refuses(argv, ERROR, (path, "'wrapopt.analytical/1'"), capsys)


def test_stated_gpus_per_node_used_when_the_mesh_fits(tmp_path, capsys):
    """The file's GPUs per node bound the mesh's ranks per node; a mesh within them runs."""
    path = _write(tmp_path, TEMPLATE, _set("gpus_per_node", 4))
    code, err = run_cli(["estimate", *GPT, "--fabric", path, "--world-size", "8", "--gpus-per-node", "4"], capsys)
    assert code == 0, err


# --- measured fabric profiles (`wrapopt show`, --fabric) and compute profiles (--compute) -------------

FABRIC = analytical_fabric(world_size=8).to_json()
COMPUTE = analytical_compute().to_json()

PROFILES = [
    case(FABRIC, _set("world_size", 0), "'world_size' (ranks)", "positive integer", id="fabric-world-0"),
    case(FABRIC, _set("ranks_per_node", -8), "'ranks_per_node' (ranks)", id="fabric-ranks-negative"),
    case(FABRIC, _drop("ranks_per_node"), "missing field 'ranks_per_node'", id="fabric-ranks-missing"),
    case(FABRIC, _set("overlap_comm_slowdown", -0.5), "'overlap_comm_slowdown'", id="fabric-slowdown-negative"),
    case(FABRIC, _set("links.intra.bandwidth_bytes_per_s", 0), "'bandwidth_bytes_per_s' (bytes per second)",
         id="fabric-zero-bandwidth"),
    case(FABRIC, _set("format", "wrapopt.fabric/2"), "'wrapopt.fabric/2'", "'wrapopt.fabric/1'",
         id="fabric-future-format"),
    case(COMPUTE, _set("flops_per_s", 0), "'flops_per_s' (FLOP per second)", "positive", id="compute-zero-flops"),
    case(COMPUTE, _drop("flops_per_s"), "missing field 'flops_per_s'", id="compute-flops-missing"),
    case(COMPUTE, _set("memory_capacity_bytes", -1), "'memory_capacity_bytes' (bytes)", id="compute-capacity-negative"),
    case(COMPUTE, _set("unit_overhead_s", "fast"), "'unit_overhead_s' (seconds) must be", id="compute-overhead-text"),
    case(COMPUTE, _set("loss_s", -1e-3), "'loss_s' (seconds)", id="compute-loss-negative"),
    case(COMPUTE, _set("format", "wrapopt.compute/9"), "'wrapopt.compute/1'", id="compute-future-format"),
]


@pytest.mark.parametrize("good, change, fragments", PROFILES)
def test_profiles(good, change, fragments, tmp_path, capsys):
    path = _write(tmp_path, good, change)
    flag = "--fabric" if good is FABRIC else "--compute"
    assert_cli_refuses(["estimate", *GPT, "--world-size", "8", flag, path], ERROR, (path, *fragments), capsys)


# --- plan files (`wrapopt show`, `estimate --plan`) ----------------------------------------------

@pytest.fixture(scope="module")
def plan_json(tmp_path_factory) -> dict:
    """A plan for gpt-tiny on 2 ranks (baselines and the exact DP; no Optuna trials)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    from wrapopt.cli.main import main

    assert main(["search", *GPT, "--world-size", "2", "--trials", "0", "--out", str(path)]) == 0
    with open(path) as f:
        return json.load(f)


PLANS = [
    case("{\"format\": \"wrapopt.plan/1\", \"units\": [", "show", id="truncated"),
    case("[1, 2]", "show", id="not-an-object"),
    case(_set("format", "wrapopt.plan/7"), "show", "newer", "upgrade wrapopt", id="future-format"),
    case(_set("mesh.world_size", "2"), "show", "mesh", id="world-size-text"),
    case(_set("mesh.world_size", 0), "show", "mesh", id="world-size-0"),
    case(_drop("units"), "show", "units", id="no-units"),
    case(_set("units.0.checkpoint", "yes"), "show", "units[0].checkpoint", id="checkpoint-text"),
    case(_set("mesh.world_size", 4), "estimate", "mesh", id="estimate-mesh-not-the-world"),
]


@pytest.mark.parametrize("change, command, fragments", PLANS)
def test_plan_files(change, command, fragments, plan_json, tmp_path, capsys):
    path = _write(tmp_path, plan_json, change, name="plan.json")
    argv = ["show", path] if command == "show" else ["estimate", *GPT, "--plan", path, "--world-size", "2"]
    assert_cli_refuses(argv, ERROR, (path, *fragments), capsys)


# --- Hugging Face configs (hf:config.json) ---------------------------------------------------------

HF = [
    case(_set("pad_token_id", 128), [], "`pad_token_id` = 128", "outside the vocabulary", id="pad-past-vocab"),
    case(_set("num_attention_heads", 3), [], "hidden size (32)", "attention heads (3)", id="heads-split"),
    case(_set("vocab_size", 0), [], "`vocab_size`", "positive integer", id="vocab-0"),
    case(_set("hidden_size", "32"), [], "`hidden_size`", "without quotes", id="size-as-text"),
    case(_set("num_key_value_heads", 3), [], "`num_key_value_heads` = 3", id="kv-heads"),
    case(_set("auto_map", {"AutoModel": "x.Y"}), [], "`auto_map`", id="auto-map"),
    case(_drop("model_type"), [], "`model_type`", id="no-model-type"),
    case(_set("model_type", "llama99"), [], "'llama99'", id="unknown-model-type"),
    case({}, ["--seq", "65"], "--seq 65", "`max_position_embeddings` = 64", id="seq-past-positions"),
    case("{\"model_type\": \"llama\",", [], "config.json", id="truncated"),
]


@pytest.mark.parametrize("change, argv, fragments", HF)
def test_hf_configs(change, argv, fragments, tmp_path, capsys):
    pytest.importorskip("transformers")
    from tests.models.hf_configs import write_config

    with open(write_config("llama", str(tmp_path))) as f:
        good = json.load(f)
    path = _write(tmp_path, good, (lambda d: None) if change == {} else change, name="config.json")
    assert_cli_refuses(["trace", f"hf:{path}", *argv], ERROR, (path, *fragments), capsys)


def test_tp_plan_file_not_an_object(tmp_path, capsys):
    path = _write(tmp_path, {}, "[\"colwise\"]", name="tp.json")
    assert_cli_refuses(["search", *GPT, "--world-size", "8", "--tp", "2", "--tp-plan", path], ERROR,
                       (path, "JSON object"), capsys)
