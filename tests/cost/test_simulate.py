"""The FSDP2 step simulator: each modelled effect moves the prediction the right way."""

from __future__ import annotations

import dataclasses

import pytest

from tests.cost.common import UniformChoices
from wrapopt.cost import Simulator, simulate
from wrapopt.errors import PlanError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.hardware.profiles import AxisProfile, CollectiveCurve, ComputeProfile, FabricProfile
from wrapopt.models.sources import zoo
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec, OptimizerKind, PlanSpec, SimOptions, UnitSpec
from wrapopt.trace.meta import trace_model


@pytest.fixture(scope="module")
def llama():
    e = zoo.get_entry("llama-7b")
    return trace_model(e.build("meta"), e.inputs())


MESH = MeshSpec(world_size=64, ranks_per_node=8, shard_size=64)
FAB = analytical_fabric(world_size=64)
GPU = analytical_compute()

def _per_block(g, mesh=MESH, **unit_kw):
    b = baselines(g, mesh)["per-block"]
    units = tuple(dataclasses.replace(u, **unit_kw) if not u.is_root else u for u in b.units)
    return PlanSpec(units, mesh, label="pb")


def test_breakdown_adds_up_and_static_terms(llama):
    est = simulate(llama, _per_block(llama), FAB, GPU)
    assert sum(v for _, v in est.peak_breakdown) == pytest.approx(est.peak_bytes, rel=1e-9)
    parts = dict(est.peak_breakdown)
    shard = llama.param_bytes / 64
    assert parts["sharded_params"] == pytest.approx(shard, rel=1e-6)
    assert parts["optimizer_state"] == pytest.approx(2 * shard, rel=1e-6)  # AdamW: two states
    assert est.step_s >= est.compute_s > 0


def test_optimizer_kind_changes_state_memory(llama):
    plan = _per_block(llama)
    adam = simulate(llama, plan, FAB, GPU, SimOptions(optimizer=OptimizerKind.ADAMW))
    sgd = simulate(llama, plan, FAB, GPU, SimOptions(optimizer=OptimizerKind.SGD_MOMENTUM))
    none = simulate(llama, plan, FAB, GPU, SimOptions(optimizer=OptimizerKind.NONE))
    assert adam.peak_bytes > sgd.peak_bytes > none.peak_bytes


def test_reshard_after_forward_false_trades_memory_for_time(llama):
    on = simulate(llama, _per_block(llama), FAB, GPU)
    off = simulate(llama, _per_block(llama, reshard_after_forward=False), FAB, GPU)
    assert off.peak_bytes > on.peak_bytes
    assert off.comm_s < on.comm_s  # no re-gather in backward


def test_checkpointing_trades_time_for_memory(llama):
    plain = simulate(llama, _per_block(llama), FAB, GPU)
    ck = simulate(llama, _per_block(llama, checkpoint=True), FAB, GPU)
    assert ck.peak_bytes < plain.peak_bytes
    assert ck.compute_s > plain.compute_s


def test_slower_fabric_is_slower(llama):
    fast = simulate(llama, _per_block(llama), FAB, GPU)
    slow = simulate(llama, _per_block(llama), analytical_fabric("h100-nvlink-eth100", world_size=64), GPU)
    assert slow.step_s > fast.step_s and slow.exposed_comm_s > fast.exposed_comm_s


def test_many_small_units_pay_latency(llama):
    b = baselines(llama, MESH)
    leaf = simulate(llama, b["every-leaf"], FAB, GPU)
    block = simulate(llama, b["per-block"], FAB, GPU)
    assert leaf.step_s > block.step_s


def test_hsdp_adds_replicate_all_reduce_and_uses_fast_axis(llama):
    # One 100 Gb/s NIC per node: FSDP's rings over 8 nodes cross it (See [Note: multi-rail rings]).
    slow = analytical_fabric("h100-nvlink-eth100", world_size=64)
    fsdp = simulate(llama, _per_block(llama), slow, GPU)
    hsdp_mesh = MeshSpec(world_size=64, ranks_per_node=8, shard_size=8)
    hsdp = simulate(llama, _per_block(llama, mesh=hsdp_mesh), slow, GPU)
    assert hsdp.step_s < fsdp.step_s  # all-gathers on NVLink instead of the network
    assert dict(hsdp.peak_breakdown)["sharded_params"] == pytest.approx(8 * dict(fsdp.peak_breakdown)["sharded_params"])


def test_mixed_precision_halves_gathered_bytes(llama):
    e = zoo.get_entry("llama-tiny")
    g = trace_model(e.build("meta"), e.inputs())  # fp32 parameters
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    plan = baselines(g, mesh)["per-block"]
    fp32 = simulate(g, plan, analytical_fabric(world_size=8), GPU)
    bf16 = simulate(g, plan, analytical_fabric(world_size=8), GPU,
                    SimOptions(param_dtype_bytes=2, reduce_dtype_bytes=2))
    assert bf16.units[0].param_bytes * 2 == fp32.units[0].param_bytes
    assert bf16.comm_s < fp32.comm_s


def test_gradient_accumulation_costs_micro_batches(llama):
    one = simulate(llama, _per_block(llama), FAB, GPU)
    four = simulate(llama, _per_block(llama), FAB, GPU, SimOptions(grad_accumulation=4))
    assert four.step_s > 3 * one.compute_s
    assert dict(four.peak_breakdown).get("accumulated_grads", 0) > 0


def test_cpu_collectives_block_and_a_gpu_overlaps_them():
    """[Note: blocking collectives] in cost/step.py: on a CPU every collective holds the rank, so
    the step is its compute, its collectives and FSDP2's overheads one after the other, and an
    explicit prefetch gains nothing; on a GPU the comm lane runs beside compute."""
    e = zoo.get_entry("gpt-tiny")
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    cpu = ComputeProfile(kind="measured", device="cpu", runs_ahead=False, flops_per_s=5e10,
                         memory_bandwidth_bytes_per_s=1e10, unit_overhead_s=1e-4)
    fab = analytical_fabric(world_size=2)
    plan = baselines(g, mesh)["per-block"]
    implicit = simulate(g, plan, fab, cpu)
    explicit = simulate(g, dataclasses.replace(plan, forward_prefetch=1), fab, cpu)
    assert explicit.fwd_s == pytest.approx(implicit.fwd_s) and explicit.step_s == pytest.approx(implicit.step_s)
    serial = implicit.compute_s + implicit.comm_s + implicit.optim_s
    assert implicit.step_s >= serial * (1 - 1e-9)  # nothing overlaps (overheads on top)
    gpu = dataclasses.replace(cpu, runs_ahead=True)
    ahead = simulate(g, plan, fab, gpu)
    assert ahead.step_s < implicit.step_s


def test_a_checkpointed_block_pays_its_forward_part_of_the_overhead_in_forward():
    """[Note: checkpoint overhead] in cost/step.py: of ``checkpoint_overhead_s`` per checkpointed
    block, ``checkpoint_forward_s`` moves from the recompute to the forward; the step's total
    stays (CPU: nothing overlaps), and the chain DP's group figures move alike."""
    from wrapopt.search.dp.chain import chain_costs, group_figures

    e = zoo.get_entry("gpt-tiny")
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    cpu = ComputeProfile(kind="measured", device="cpu", runs_ahead=False, flops_per_s=5e10,
                         memory_bandwidth_bytes_per_s=1e10, unit_overhead_s=1e-4, checkpoint_overhead_s=1e-3)
    split = dataclasses.replace(cpu, checkpoint_forward_s=4e-4)
    fab = analytical_fabric(world_size=2)
    plan = baselines(g, mesh)["per-block,ckpt"]
    blocks = len(g.block_chains[0])
    a, b = simulate(g, plan, fab, cpu), simulate(g, plan, fab, split)
    assert b.fwd_s - a.fwd_s == pytest.approx(blocks * 4e-4, rel=1e-6)
    assert a.bwd_s - b.bwd_s == pytest.approx(blocks * 4e-4, rel=1e-6)
    assert b.step_s == pytest.approx(a.step_s, rel=1e-9)
    ca, cb = (chain_costs(Simulator(g, fab, c), mesh, g.block_chains[0], max_group=2) for c in (cpu, split))
    fa, fb = group_figures(ca, 0, 2, (True, True)), group_figures(cb, 0, 2, (True, True))
    assert fb[0] - fa[0] == pytest.approx(2 * 4e-4) and fa[1] - fb[1] == pytest.approx(2 * 4e-4)
    assert group_figures(cb, 0, 2, (True, False))[:2] == group_figures(ca, 0, 2, (True, False))[:2]


def test_illegal_plans_are_rejected_with_names():
    e = zoo.get_entry("gpt-tiny")
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    root = UnitSpec(("",), False)
    with pytest.raises(PlanError, match="wte.weight"):
        simulate(g, PlanSpec((UnitSpec(("wte",)), root), mesh), FAB, GPU)
    with pytest.raises(PlanError, match="layers.0"):
        simulate(g, PlanSpec((UnitSpec(("layers.0",)), UnitSpec(("layers.0",)), root), mesh), FAB, GPU)
    with pytest.raises(PlanError, match="nope"):
        simulate(g, PlanSpec((UnitSpec(("nope",)), root), mesh), FAB, GPU)


def test_extrapolation_is_reported_not_fatal(llama):
    curve = CollectiveCurve((4096, 65536), (1e-4, 3e-4))
    axis = AxisProfile("world", 64, 8, tuple((c, curve) for c in ("all_gather", "reduce_scatter", "all_reduce")))
    fab = FabricProfile(kind="measured", name="tiny-table", backend="gloo", world_size=64, ranks_per_node=8,
                        axes=(axis,))
    est = Simulator(llama, fab, GPU).simulate(_per_block(llama))
    assert est.step_s > 0
    assert any("extrapolated" in n for n in est.notes)


def test_timeline_is_ordered_per_lane(llama):
    est = simulate(llama, _per_block(llama), FAB, GPU, record=True)
    for lane in ("compute", "comm"):
        ev = [e for e in est.timeline if e.lane == lane]
        assert ev
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(ev, ev[1:]))
    assert max(e.end_s for e in est.timeline) == pytest.approx(est.step_s)


def test_optimizer_step_uses_its_calibrated_bandwidth_and_2d_mesh_dispatch():
    e = zoo.get_entry("gpt-tiny")
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss, fx=False)
    fsdp = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    noshard = MeshSpec(world_size=2, ranks_per_node=2, shard_size=1)
    base = ComputeProfile(kind="measured", device="cpu", runs_ahead=False,
                          flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10,
                          optimizer_tensor_s=1e-4)
    fab = analytical_fabric(world_size=2)

    def optim_s(cp, mesh):
        plan = baselines(g, mesh)["root-only"] if mesh.shard_size > 1 else baselines(g, mesh)["no-shard"]
        est = Simulator(g, fab, cp).simulate(plan, record=True)
        return next(ev.end_s - ev.start_s for ev in est.timeline if ev.kind == "optim")

    slow_bw = dataclasses.replace(base, optimizer_bandwidth_bytes_per_s=1e9)
    storage = g.param_bytes  # fp32 model: 6 counted bytes per parameter byte for AdamW, half of it per rank
    assert optim_s(slow_bw, fsdp) - optim_s(base, fsdp) == pytest.approx(storage / 2 * 6 * (1e-9 - 1e-10), rel=0.05)
    # No-shard runs on a 2-D (replicate, shard) mesh: its per-tensor cost applies there only.
    slow_2d = dataclasses.replace(base, optimizer_tensor_2d_s=3e-4)
    assert optim_s(slow_2d, fsdp) == pytest.approx(optim_s(base, fsdp))
    assert optim_s(slow_2d, noshard) > optim_s(base, noshard) + 0.9 * len(g.param_shapes) * 2e-4
    assert ComputeProfile.from_json(slow_2d.to_json()) == slow_2d


def test_caches_never_change_a_result():
    """See [Note: simulator speed]: layouts, per-unit collective costs and backward
    working sets are cached across plans; a fresh simulator must agree exactly."""
    from wrapopt.search.study.space import SearchSpace

    model, x = zoo.build("t5-tiny", "meta")
    g = trace_model(model, x)
    mesh = MeshSpec(world_size=16, ranks_per_node=4, shard_size=16)
    fab = analytical_fabric(world_size=16, ranks_per_node=4)
    comp = analytical_compute()
    opts = SimOptions(param_dtype_bytes=2, reduce_dtype_bytes=4)
    space = SearchSpace(g, mesh)
    src = UniformChoices(0)
    plans = [space.decode(src) for _ in range(60)] + list(baselines(g, mesh).values())
    assert len({tuple(u.modules for u in p.units) for p in plans}) > 30  # many different layouts
    assert len({p.mesh.shard_size for p in plans}) > 1  # FSDP and HSDP meshes
    shared = Simulator(g, fab, comp, opts)
    for p in plans + plans[::-1]:  # every plan scored after many others, twice
        assert shared.simulate(p, record=True) == Simulator(g, fab, comp, opts).simulate(p, record=True), p.label
