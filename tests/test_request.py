"""The parallel request (``wrapopt.spec.request``) and the one wiring (``wrapopt.job.prepare``):
See [Note: the parallel request] in wrapopt/spec/request.py."""

from __future__ import annotations

import dataclasses

import pytest

from wrapopt.errors import OptionError, ProfileError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.job import prepare
from wrapopt.models import zoo
from wrapopt.spec import AUTO, MeshSpec, ParallelRequest, Shape, parse_degree
from wrapopt.train import TrainConfig

MESH = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)


@pytest.mark.parametrize("value, want", [(None, 1), (1, 1), ("1", 1), (4, 4), (" 8 ", 8), ("auto", AUTO)])
def test_a_degree_is_auto_or_a_positive_int(value, want):
    assert parse_degree(value, "--tp") == want


@pytest.mark.parametrize("value", [0, -2, "two", "2.5", 2.5, True, "", [2]])
def test_a_bad_degree_names_the_flag(value):
    with pytest.raises(OptionError, match=r"--pp must be auto or a positive integer"):
        parse_degree(value, "--pp")


def test_the_request_normalises_each_axis_once():
    req = ParallelRequest(mesh=MESH, tp="4", pp=None, cp="1")
    assert (req.tp, req.pp, req.cp, req.ep) == (4, 1, 1, 1)
    assert req.asks_tp and not req.asks_pp and not req.searches_tp
    auto = ParallelRequest(mesh=MESH, tp="auto", pp="auto")
    assert auto.searches_tp and auto.searches_pp and auto.asks_pp
    assert ParallelRequest(mesh=MESH) == ParallelRequest(mesh=MESH, tp=1, pp="1")  # one value, however spelled


def test_every_bad_field_is_named_on_its_own_line():
    with pytest.raises(OptionError) as e:
        ParallelRequest(mesh=MESH, tp=3, pp=5, cp=3, ep=6, global_batch=0, dp_shard=3, host_memory=2**30,
                        memory_budget="lots")
    lines = str(e.value).splitlines()
    assert lines[0] == "the parallel request has bad fields:"
    body = "\n".join(lines[1:])
    for words in ("--tp 3 does not divide the 8 GPUs per node", "--pp 5 does not divide the world of 16",
                  "--cp 3: the context-parallel degree does not divide the 16 ranks left by tp and pp",
                  "degrees that do: 2, 4, 8, 16", "--ep 6: the expert-parallel degree does not divide",
                  "--cp 3 with --ep 6 and --global-batch: context and expert parallelism together are searched per "
                  "local batch only",
                  "--global-batch must be at least 1", "--shard-size 3 must divide the world of 16",
                  "--host-memory is only read with --offload", "memory_budget (--memory) 'lots' is not a memory size"):
        assert words in body
    assert len(lines) == 10  # the heading and nine problems, one line each


def test_one_bad_field_is_one_line():
    with pytest.raises(OptionError) as e:
        ParallelRequest(mesh=MESH, tp="two")
    assert str(e.value) == "--tp must be auto or a positive integer, got 'two'"


def test_tp_switches_are_checked():
    req = ParallelRequest(mesh=MESH, tp=2)
    assert req.sequence_parallel and req.loss_parallel and req.async_tp == "auto"
    with pytest.raises(OptionError, match="async_tp must be True, False or \"auto\", got 'yes'"):
        ParallelRequest(mesh=MESH, tp=2, async_tp="yes")
    with pytest.raises(OptionError, match="sequence_parallel must be True or False"):
        ParallelRequest(mesh=MESH, tp=2, sequence_parallel=1)


def test_a_shape_counts_its_data_parallel_ranks():
    assert Shape(pp=2, tp=4).dp(64) == 8
    assert Shape().dp(8) == 8 and Shape().describe() == "1-D"
    assert Shape(pp=2, tp=8).describe() == "pp2 tp8"


def test_prepare_wires_the_request_once():
    model, x = zoo.build("gpt-tiny", "meta")
    train = TrainConfig.preset("bf16")
    req = ParallelRequest(mesh=MeshSpec(world_size=2, ranks_per_node=2, shard_size=2), memory_budget="64MiB",
                          train=train)
    job = prepare(req, model, x, fabric=analytical_fabric(world_size=2), compute=analytical_compute())
    assert job.budget == 64 * 2**20 and "64MiB" in job.budget_source
    assert job.graph.compute_dtype == "bfloat16"  # traced in the step's dtype
    # compile settled against the stated GPU: on (See [Note: knob defaults] in wrapopt/search/knobs.py)
    assert job.train == dataclasses.replace(train, compile=True)
    assert job.sim.options == job.train.sim_options(memory_budget=job.budget)
    half = job.simulator(batch_scale=0.5)
    # the compiled step's compute is the job's, rewritten by cost/fused.py's with_knobs: equal, not the same object
    assert half.options.batch_scale == 0.5 and half.fabric is job.fabric and half.compute == job.compute
    # no step given: the default one, recorded in the request the job carries
    assert prepare(ParallelRequest(mesh=req.mesh), model, graph=job.graph).request.train == TrainConfig(compile=True)


def test_prepare_refuses_a_budget_the_device_cannot_resolve_before_tracing(monkeypatch):
    import wrapopt.job

    def no_trace(*_a, **_k):
        raise AssertionError("traced before the budget was checked")

    monkeypatch.setattr(wrapopt.job, "trace_model", no_trace)
    model, x = zoo.build("gpt-tiny", "meta")
    req = ParallelRequest(mesh=MeshSpec(world_size=2, ranks_per_node=2, shard_size=2), memory_budget="auto")
    no_capacity = dataclasses.replace(analytical_compute(), memory_capacity_bytes=None)
    with pytest.raises(ValueError, match="--memory auto needs a device capacity"):
        prepare(req, model, x, compute=no_capacity)


def test_prepare_checks_a_measured_fabric_against_the_mesh():
    model, x = zoo.build("gpt-tiny", "meta")
    measured = dataclasses.replace(analytical_fabric(world_size=4, ranks_per_node=4), kind="measured")
    req = ParallelRequest(mesh=MeshSpec(world_size=2, ranks_per_node=2, shard_size=2))
    with pytest.raises(ProfileError, match="measured on 4 ranks"):
        prepare(req, model, x, fabric=measured)
    job = prepare(req, model, x, fabric=measured, rescale_fabric=True)
    assert any("rescaled" in n for n in job.notes)


def test_a_shape_has_one_cost_view():
    from wrapopt.cost import Simulator
    from wrapopt.tp import builtin_tp_plan
    from wrapopt.trace.meta import trace_model

    model, x = zoo.build("llama-tiny", "meta")
    g = trace_model(model, x)
    sim = Simulator(g, analytical_fabric(world_size=8), analytical_compute())
    spec = builtin_tp_plan(g)
    assert sim.view(Shape()) is sim  # 1-D: the model's own simulator
    assert sim.view(Shape(pp=2)) is sim  # a pipeline's stages are views of it (for_stage)
    two = sim.view(Shape(tp=2), spec)
    assert two is sim.for_tp(spec, 2)[0]  # one tensor-parallel rank's share, cached
    assert two.traced.root.total_numel < g.root.total_numel  # the split projections hold half
    with pytest.raises(ValueError, match="needs the TPSpec"):
        sim.view(Shape(tp=2))
    cp = sim.view(Shape(cp=2))  # one context-parallel rank's share: See [Note: context parallel costs]
    assert cp is sim.for_cp(2, 2)[0] and cp.options.batch_scale == sim.options.batch_scale / 2
