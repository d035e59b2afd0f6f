"""Memory around the collectives as FSDP2 (torch 2.13) holds it: [Note: collective copies],
[Note: all-gather buffer] and [Note: pre-backward] in cost/step.py; and the
optimizer stepping trainable tensors only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wrapopt import zoo
from wrapopt.cost.dtypes import trainable_tensors
from wrapopt.cost.simulate import Simulator
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec, SimOptions
from wrapopt.trace import trace_model

MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)


@pytest.fixture(scope="module")
def llama():
    model, x = zoo.build("llama-tiny", "meta")
    return trace_model(model, x)


def _sims(graph):
    fabric, compute = analytical_fabric(world_size=2), replace(analytical_compute(), runs_ahead=False)
    return Simulator(graph, fabric, compute), Simulator(graph, replace(fabric, collective_copies=1.0), compute)


def test_a_copying_backend_holds_its_copy_while_the_all_gather_runs(llama):
    """Every all-gather of a per-block plan holds one more copy of what it gathers while it
    runs, and nothing more after: the timelines differ by exactly that at each all-gather."""
    plain, copying = (s.simulate(baselines(llama, MESH)["per-block"], record=True) for s in _sims(llama))
    gathers = [(a, b) for a, b in zip(plain.timeline, copying.timeline) if a.kind == "all_gather"]
    size = {u.name: u.param_bytes for u in plain.units}
    assert gathers
    assert all(b.memory_bytes - a.memory_bytes == pytest.approx(size[a.unit], abs=8) for a, b in gathers)
    others = [(a, b) for a, b in zip(plain.timeline, copying.timeline) if a.kind in ("fwd", "bwd")]
    assert all(a.memory_bytes == b.memory_bytes for a, b in others)


def test_a_root_only_plan_holds_its_all_gather_output_through_forward():
    """[Note: all-gather buffer]: while forward computes, the one unit's all-gather output is
    held beside its unsharded parameters; wide-shallow (parameters >> activations) peaks there.
    The root's post-forward frees it: the loss's moment holds no buffer."""
    model, x = zoo.build("wide-shallow", "meta")
    graph = trace_model(model, x)
    est = _sims(graph)[0].simulate(baselines(graph, MESH)["root-only"], record=True)
    whole = est.units[-1].param_bytes
    parts = dict(est.peak_breakdown)
    assert parts["all_gather_buffer"] == whole == parts["unsharded_params"]
    fwd = max(e.memory_bytes for e in est.timeline if e.kind == "fwd")
    bwd = max(e.memory_bytes for e in est.timeline if e.kind == "bwd")
    assert fwd > bwd  # forward holds the buffer; backward does not


def test_the_optimizer_steps_trainable_tensors_only():
    """A frozen base with adapters: the per-tensor cost is paid for the adapters' tensors."""
    model, x = zoo.build("lora-tiny", "meta")
    graph = trace_model(model, x)
    assert trainable_tensors(graph) == sum(p.requires_grad for p in model.parameters()) < len(graph.param_shapes)
    compute = replace(analytical_compute(), runs_ahead=False, optimizer_tensor_s=1e-3)
    est = Simulator(graph, analytical_fabric(world_size=2), compute).simulate(baselines(graph, MESH)["per-block"])
    assert est.optim_s == pytest.approx(trainable_tensors(graph) * 1e-3, rel=0.05)


@pytest.mark.parametrize("sync", ["every", "last"])
def test_a_shard_group_of_one_holds_no_buffer_nor_copy_with_accumulation(sync):
    """No-shard gathers nothing, so it keeps no all-gather output and no collective copy, in
    either accumulation mode: 'every' runs the loop with gradients already sharded (an infinite
    shard), which must not pass for a shard group of many ranks."""
    model, x = zoo.build("wide-shallow", "meta")
    graph = trace_model(model, x)
    fabric, compute = analytical_fabric(world_size=2), replace(analytical_compute(), runs_ahead=False)
    options = SimOptions(grad_accumulation=2, accumulation_sync=sync)
    plan = baselines(graph, MESH)["no-shard"]
    plain, copying = (Simulator(graph, f, compute, options).simulate(plan)
                      for f in (fabric, replace(fabric, collective_copies=1.0)))
    assert dict(plain.peak_breakdown)["all_gather_buffer"] == 0
    assert copying.peak_bytes == plain.peak_bytes
    sharded = Simulator(graph, fabric, compute, options).simulate(baselines(graph, MESH)["root-only"])
    assert dict(sharded.peak_breakdown)["all_gather_buffer"] > 0  # a real shard group keeps it, in this mode too


def test_a_shard_group_of_one_pays_the_per_unit_overhead_in_forward_too(llama):
    """[Note: shard group of one]: FSDP2's unshard on a group of one still runs its copy-in, its
    all-gather of one rank and its copy-out, so the per-unit overhead is charged in forward as on
    a real shard group, and in backward. The chain DP's group costs follow the same rule."""
    from wrapopt.search.dp.chain import chain_costs

    fabric = analytical_fabric(world_size=2)
    base = replace(analytical_compute(), runs_ahead=False, unit_overhead_s=0.0)
    slow = replace(base, unit_overhead_s=1e-3)
    for mesh, name in ((MeshSpec(world_size=2, ranks_per_node=2, shard_size=1), "no-shard"), (MESH, "per-block")):
        plan = baselines(llama, mesh)[name]
        a, b = (Simulator(llama, fabric, c).simulate(plan) for c in (base, slow))
        units = len(plan.units)
        assert b.fwd_s - a.fwd_s == pytest.approx(units * 1e-3, rel=1e-6)
        assert b.bwd_s - a.bwd_s >= units * 1e-3 * (1 - 1e-6)
        cc = chain_costs(Simulator(llama, fabric, slow), mesh, llama.block_chains[0], max_group=2)
        assert cc.overhead_s == 1e-3


def test_a_unit_pays_for_its_parameter_tensors_at_each_gather_and_reduction(llama):
    """[Note: per-parameter overhead] in hardware/measure_fsdp.py: a unit is charged
    ``param_overhead_s`` per parameter tensor it owns at its forward all-gather, at its backward
    re-gather (resharded units) and at its reduction; the chain DP's blocks carry the same."""
    from wrapopt.search.dp.chain import chain_costs

    fabric = analytical_fabric(world_size=2)
    base = replace(analytical_compute(), runs_ahead=False, unit_overhead_s=1e-3)
    per = replace(base, param_overhead_s=1e-5)
    tensors = len(llama.param_shapes)
    root_only = baselines(llama, MESH)["size-1e8"]  # one unit: the root owns every parameter
    assert len(root_only.units) == 1
    a, b = (Simulator(llama, fabric, c).simulate(root_only) for c in (base, per))
    assert b.fwd_s - a.fwd_s == pytest.approx(tensors * 1e-5, rel=1e-6)  # the root is not resharded: one gather
    assert b.bwd_s - a.bwd_s == pytest.approx(tensors * 1e-5, rel=1e-6)  # and one reduction
    per_block = baselines(llama, MESH)["per-block"]  # every block resharded: gathered twice, reduced once
    a, b = (Simulator(llama, fabric, c).simulate(per_block) for c in (base, per))
    block = sum(1 for f, _s, _d in llama.param_shapes if f.startswith("layers.0."))
    blocks = sum(1 for f, _s, _d in llama.param_shapes if f.startswith("layers."))
    assert b.fwd_s - a.fwd_s == pytest.approx(tensors * 1e-5, rel=1e-6)
    assert b.bwd_s - a.bwd_s == pytest.approx((tensors + blocks) * 1e-5, rel=1e-6)
    lo, hi = (chain_costs(Simulator(llama, fabric, c), MESH, llama.block_chains[0], max_group=2) for c in (base, per))
    assert hi.F[0] - lo.F[0] == pytest.approx(block * 1e-5) and hi.B[0] - lo.B[0] == pytest.approx(block * 1e-5)


def test_a_unit_pays_for_its_gathered_bytes_at_each_gather_and_reduction(llama):
    """[Note: per-byte overhead] in hardware/measure_fsdp.py: a unit is charged ``byte_overhead_s`` per
    byte it gathers at its forward all-gather, its re-gather and its reduction; the DP's blocks alike."""
    import math

    from wrapopt.search.dp.chain import chain_costs

    fabric = analytical_fabric(world_size=2)
    base = replace(analytical_compute(), runs_ahead=False, unit_overhead_s=1e-3)
    per = replace(base, byte_overhead_s=1e-9)
    nbytes = 4 * sum(math.prod(s) for _f, s, _d in llama.param_shapes)  # float32
    root_only = baselines(llama, MESH)["size-1e8"]
    a, b = (Simulator(llama, fabric, c).simulate(root_only) for c in (base, per))
    assert b.fwd_s - a.fwd_s == pytest.approx(nbytes * 1e-9, rel=1e-6)  # one gather
    assert b.bwd_s - a.bwd_s == pytest.approx(nbytes * 1e-9, rel=1e-6)  # one reduction
    block = 4 * sum(math.prod(s) for f, s, _d in llama.param_shapes if f.startswith("layers.0."))
    lo, hi = (chain_costs(Simulator(llama, fabric, c), MESH, llama.block_chains[0], max_group=2) for c in (base, per))
    assert hi.F[0] - lo.F[0] == pytest.approx(block * 1e-9) and hi.B[0] - lo.B[0] == pytest.approx(block * 1e-9)
