"""CPU offload (cost/state.py, search/offload.py, hardware/host.py): priced as FSDP2 runs it,
searched beside the rest and chosen only where it is the fastest plan that fits, refused on CPU
ranks, recorded in the plan file."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from wrapopt.cli.main import main
from wrapopt.cost import Simulator
from wrapopt.errors import OptionError, PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.hardware.host import host_for
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.plan.apply import apply_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec
from wrapopt.train import TrainConfig

MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


@pytest.fixture(scope="module")
def priced(llama_tiny):
    _model, _inputs, graph = llama_tiny
    fabric = analytical_fabric("h100+ib400", world_size=8, ranks_per_node=8)
    host = host_for(fabric, host_memory_bytes=2 * 10**12, ranks_per_node=8)
    sim = Simulator(graph, fabric, analytical_compute("h100"), TrainConfig().sim_options(), host=host)
    return graph, sim, host


def test_offload_moves_the_sharded_state_off_the_gpu_and_pays_the_copies(priced):
    graph, sim, host = priced
    plan = baselines(graph, MESH)["per-block"]
    on, off = sim.simulate(replace(plan, offload=True)), sim.simulate(plan)
    parts_on, parts_off = dict(on.peak_breakdown), dict(off.peak_breakdown)
    assert parts_on["sharded_params"] == parts_on["optimizer_state"] == parts_on["sharded_grads"] == 0
    assert parts_off["sharded_params"] > 0 and parts_off["optimizer_state"] > 0
    assert on.peak_bytes < off.peak_bytes
    # every all-gather carries its shard's host-to-device copy, every reduce-scatter the copy back
    for u_on, u_off in zip(on.units, off.units):
        assert u_on.all_gather_s == pytest.approx(u_off.all_gather_s + u_off.param_bytes / 8 / host.link_bytes_per_s,
                                                  rel=0.5)
        assert u_on.all_gather_s > u_off.all_gather_s and u_on.reduce_scatter_s > u_off.reduce_scatter_s
    assert on.optim_s != off.optim_s  # stepped on the CPU, over the host DRAM
    assert sim.host_bytes_per_rank(plan) == pytest.approx(
        (graph.param_bytes + graph.trainable_bytes * (1 + 2)) / 8, rel=0.01)  # params, fp32 grads, AdamW's 2 states


def test_a_simulator_without_a_host_prices_offload_on_the_stated_gpus_host(llama_tiny):
    # See [Note: a host to price offload] in cost/simulate.py: estimate of an offload plan file
    # has no --host-memory; the stated GPU's host link prices it, its memory marked not stated.
    _model, _inputs, graph = llama_tiny
    plan = replace(baselines(graph, MESH)["per-block"], offload=True)
    fabric = analytical_fabric("h100+ib400", world_size=8, ranks_per_node=8)
    sim = Simulator(graph, fabric, analytical_compute("h100"))
    stated = host_for(fabric, host_memory_bytes=10**12, ranks_per_node=8)
    given = Simulator(graph, fabric, analytical_compute("h100"), host=stated)
    assert sim.simulate(plan).step_s == given.simulate(plan).step_s  # memory is not priced, the link is
    assert "host memory not stated" in sim.host.source
    measured = replace(fabric, kind="measured")  # a fabric that states no host is refused, naming --gpu
    with pytest.raises(OptionError, match="--gpu"):
        Simulator(graph, measured, analytical_compute("h100")).simulate(plan)


def test_offload_needs_a_host_memory_and_a_stated_gpu():
    fabric = analytical_fabric("h100+ib400", world_size=8, ranks_per_node=8)
    with pytest.raises(OptionError, match="--host-memory"):
        host_for(fabric, host_memory_bytes=None, ranks_per_node=8)
    with pytest.raises(OptionError, match="states none"):
        host_for(None, host_memory_bytes=10**12, ranks_per_node=8)


def test_the_plan_file_round_trips_offload_and_cpu_ranks_refuse_it(llama_tiny, tmp_path):
    model, _inputs, graph = llama_tiny
    spec = replace(baselines(graph, MeshSpec(world_size=1, ranks_per_node=1, shard_size=1))["per-block"], offload=True)
    plan = WrapPlan(spec=spec, model=model_fingerprint(model))
    plan.save(tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["offload"] is True
    assert WrapPlan.load(tmp_path / "p.json").spec.offload
    data = plan.to_json()
    data["offload"] = "yes"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="'offload' must be true or false"):
        WrapPlan.load(tmp_path / "bad.json")
    with pytest.raises(PlanError, match="needs GPU ranks; these ranks run on cpu"):
        apply_plan(model, spec)  # refused before any collective (no process group here)


def test_cli_chooses_offload_only_when_nothing_else_fits(capsys):
    args = ["search", "zoo:llama-7b", "--world-size", "8", "--gpus-per-node", "8", "--gpu", "h100", "--network",
            "ib400", "--precision", "bf16", "--trials", "0"]
    assert main([*args, "--memory", "80GB", "--offload", "--host-memory", "1.8TB", "--json"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert "offload" not in roomy and any("not chosen" in n for n in roomy["fabric"]["notes"])
    assert main([*args, "--memory", "6GB", "--offload", "--host-memory", "1.8TB", "--json"]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["offload"] is True and any("nothing fits without it" in n for n in tight["fabric"]["notes"])
    assert main([*args, "--offload"]) == 1
    assert "--host-memory" in capsys.readouterr().err
    assert main([*args, "--memory", "6GB", "--offload", "--host-memory", "10GB"]) == 1
    assert "host memory per node" in capsys.readouterr().err
