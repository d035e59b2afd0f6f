"""[Note: batch scaling] in cost/calls.py: measured module times at another batch keep their fixed share."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from wrapopt.cost.calls import module_time
from wrapopt.cost.simulate import Simulator
from wrapopt.hardware.measure_device import measure_batch_fixed_share
from wrapopt.hardware.presets import analytical_fabric
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.models import zoo
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec, SimOptions
from wrapopt.trace.meta import trace_model


@pytest.fixture(scope="module")
def llama():
    e = zoo.get_entry("llama-tiny")
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
    times = tuple((m.fqn, 1e-4, 2e-4) for m in g.modules)
    prof = ComputeProfile(kind="measured", device="cpu", flops_per_s=1e11, memory_bandwidth_bytes_per_s=1e10,
                          module_times=times)
    return g, prof


def test_a_measured_module_keeps_its_fixed_share_at_another_batch(llama):
    g, prof = llama
    m = g.info(g.blocks[0])
    assert module_time(m, prof, 0.5) == pytest.approx((0.5e-4, 1e-4))  # linear without a fixed share
    fixed = replace(prof, batch_fixed_share=0.3)
    assert module_time(m, fixed, 0.5) == pytest.approx((1e-4 * 0.65, 2e-4 * 0.65))
    assert module_time(m, fixed, 1.0) == pytest.approx((1e-4, 2e-4))  # the traced batch: as measured


def test_a_smaller_micro_batch_costs_more_per_sequence_with_a_fixed_share(llama):
    g, prof = llama
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    plan = baselines(g, mesh)["per-block"]
    fab = analytical_fabric(world_size=2)

    def compute_s(p, scale):
        return Simulator(g, fab, p, SimOptions(batch_scale=scale)).simulate(plan).compute_s

    lin, fixed = compute_s(prof, 0.5) / compute_s(prof, 1.0), compute_s(replace(prof, batch_fixed_share=0.3), 0.5) / \
        compute_s(replace(prof, batch_fixed_share=0.3), 1.0)
    assert lin == pytest.approx(0.5, rel=0.02) and fixed == pytest.approx(0.65, rel=0.02)


def test_the_share_round_trips_and_old_files_read_as_linear(llama):
    _g, prof = llama
    p = replace(prof, batch_fixed_share=0.25, pipeline_action_s=1e-3)
    back = ComputeProfile.from_json(p.to_json())
    assert (back.batch_fixed_share, back.pipeline_action_s) == (0.25, 1e-3)
    old = p.to_json()
    del old["batch_fixed_share"], old["pipeline_action_s"]
    assert (ComputeProfile.from_json(old).batch_fixed_share, ComputeProfile.from_json(old).pipeline_action_s) == (0, 0)


def test_the_share_is_measured_on_the_model_and_needs_a_batch_of_two():
    torch.manual_seed(0)
    e = zoo.get_entry("llama-tiny")
    model = e.build("cpu", seed=0)
    k = measure_batch_fixed_share(model, e.inputs(), e.loss, repeats=2)
    assert 0.0 <= k <= 0.9
    assert all(p.grad is None for p in model.parameters())  # gradients cleared
    assert measure_batch_fixed_share(model, e.inputs(1), e.loss, repeats=1) == 0.0  # a batch of one: no half
