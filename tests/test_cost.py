"""The FSDP2 step simulator: each modelled effect moves the prediction the right way."""

from __future__ import annotations

import dataclasses
import random

import pytest

from wrapopt.cost import Simulator, simulate
from wrapopt.errors import PlanError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.hardware.profiles import AxisProfile, CollectiveCurve, ComputeProfile, FabricProfile
from wrapopt.models import zoo
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


class _Random:
    """A random source for ``SearchSpace.decode``: every choice uniform."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def cat(self, name, choices):
        return self.rng.choice(choices)


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
    fsdp = simulate(llama, _per_block(llama), FAB, GPU)
    hsdp_mesh = MeshSpec(world_size=64, ranks_per_node=8, shard_size=8)
    hsdp = simulate(llama, _per_block(llama, mesh=hsdp_mesh), FAB, GPU)
    assert hsdp.step_s < fsdp.step_s  # all-gathers on NVLink instead of InfiniBand
    assert dict(hsdp.peak_breakdown)["sharded_params"] == pytest.approx(8 * dict(fsdp.peak_breakdown)["sharded_params"])


def test_mixed_precision_halves_gathered_bytes(llama):
    e = zoo.get_entry("llama-tiny")
    g = trace_model(e.build("meta"), e.inputs())  # fp32 parameters
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    plan = baselines(g, mesh)["per-block"]
    fp32 = simulate(g, plan, analytical_fabric(world_size=8), GPU)
    bf16 = simulate(g, plan, analytical_fabric(world_size=8), GPU, SimOptions(param_dtype_bytes=2, reduce_dtype_bytes=2))
    assert bf16.units[0].param_bytes * 2 == fp32.units[0].param_bytes
    assert bf16.comm_s < fp32.comm_s


def test_gradient_accumulation_costs_micro_batches(llama):
    one = simulate(llama, _per_block(llama), FAB, GPU)
    four = simulate(llama, _per_block(llama), FAB, GPU, SimOptions(grad_accumulation=4))
    assert four.step_s > 3 * one.compute_s
    assert dict(four.peak_breakdown).get("accumulated_grads", 0) > 0


def test_cpu_without_prefetch_exposes_all_gathers():
    e = zoo.get_entry("gpt-tiny")
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    cpu = ComputeProfile(kind="measured", device="cpu", runs_ahead=False, flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10)
    fab = analytical_fabric(world_size=2)
    plan = baselines(g, mesh)["per-block"]
    implicit = simulate(g, plan, fab, cpu)
    explicit = simulate(g, dataclasses.replace(plan, forward_prefetch=1), fab, cpu)
    assert explicit.fwd_s < implicit.fwd_s


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
    fab = FabricProfile(kind="measured", name="tiny-table", backend="gloo", world_size=64, ranks_per_node=8, axes=(axis,))
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
    base = ComputeProfile(kind="measured", device="cpu", runs_ahead=False, flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10,
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
    src = _Random(0)
    plans = [space.decode(src) for _ in range(60)] + list(baselines(g, mesh).values())
    assert len({tuple(u.modules for u in p.units) for p in plans}) > 30  # many different layouts
    assert len({p.mesh.shard_size for p in plans}) > 1  # FSDP and HSDP meshes
    shared = Simulator(g, fab, comp, opts)
    for p in plans + plans[::-1]:  # every plan scored after many others, twice
        assert shared.simulate(p, record=True) == Simulator(g, fab, comp, opts).simulate(p, record=True), p.label


def test_compiled_and_python_paths_agree_exactly():
    """See [Note: compiled step loop]: numba's code (step loop on its named tuples, layout
    kernel, table lookup and merge) and the Python path give the same estimate, timeline
    included, on FSDP, HSDP and no-shard plans, GPU and CPU schedules; compiled code that
    fails falls back to Python with a warning, for the simulator it failed in only."""
    pytest.importorskip("numba")
    from wrapopt.cost.step import Backend, Kernels, compile_kernels
    from wrapopt.search.study.space import SearchSpace

    model, x = zoo.build("gpt-tiny", "meta")
    g = trace_model(model, x)
    mesh = MeshSpec(world_size=16, ranks_per_node=4, shard_size=16)
    fab = analytical_fabric(world_size=16, ranks_per_node=4)
    src = _Random(1)
    plans = [SearchSpace(g, mesh).decode(src) for _ in range(25)] + list(baselines(g, mesh).values())
    assert len({p.mesh.shard_size for p in plans}) > 2 and any(p.forward_prefetch for p in plans)
    assert any(u.checkpoint for p in plans for u in p.units)
    cpu = dataclasses.replace(GPU, device="cpu", runs_ahead=False)
    opts = SimOptions(param_dtype_bytes=2, reduce_dtype_bytes=4, grad_accumulation=2)
    for comp in (GPU, cpu):
        fast = Simulator(g, fab, comp, opts, backend="compiled")
        jit = [fast.simulate(p, record=True) for p in plans]
        assert fast.backend.name == "compiled" and fast.backend.kernels is not None  # nothing fell back
        py = [Simulator(g, fab, comp, opts, backend="python").simulate(p, record=True) for p in plans]
        assert jit == py
        assert all(e.timeline for e in jit)

    def broken(*_a):
        raise TypeError("no matching definition")

    real = compile_kernels()
    for field in dataclasses.fields(Kernels):  # the step loop, the layout kernel, the table lookup and merge
        sim = Simulator(g, fab, GPU, opts, backend=Backend("compiled", kernels=dataclasses.replace(real, **{field.name: broken})))
        with pytest.warns(UserWarning, match="compiled code failed"):
            again = sim.simulate(plans[0], record=True)
        assert sim.backend.name == "python" and sim.layout.backend is sim.backend, field.name  # Python from now on
        assert again == Simulator(g, fab, GPU, opts, backend="python").simulate(plans[0], record=True)
        assert Simulator(g, fab, GPU, opts).backend.kernels is real  # other simulators still run compiled


def test_backend_choice(monkeypatch):
    """Each ``Simulator`` owns its backend: compiled by default when numba is installed,
    Python under ``WRAPOPT_JIT=0`` or when asked; a wrong name says what is expected."""
    import importlib.util

    from wrapopt.cost.step import Backend

    g = trace_model(*zoo.build("gpt-tiny", "meta"))
    fab = analytical_fabric(world_size=16, ranks_per_node=4)
    has_numba = importlib.util.find_spec("numba") is not None
    monkeypatch.delenv("WRAPOPT_JIT", raising=False)
    assert Simulator(g, fab, GPU).backend.name == ("compiled" if has_numba else "python")
    assert Simulator(g, fab, GPU, backend="python").backend.name == "python"
    monkeypatch.setenv("WRAPOPT_JIT", "0")
    sim = Simulator(g, fab, GPU)
    assert sim.backend.name == "python" and sim.backend.kernels is None and sim.layout.backend is sim.backend
    if has_numba:
        assert Simulator(g, fab, GPU, backend="compiled").backend.name == "compiled"  # asked for: the environment yields
    mine = Backend("python")
    assert Simulator(g, fab, GPU, backend=mine).backend is mine
    with pytest.raises(ValueError, match="'compiled' .*or 'python'"):
        Simulator(g, fab, GPU, backend="numba")


def test_size_tables_lookup_and_merge():
    """The simulator's tables of collective times by size: ``lookup`` finds every key
    (NaN and a count for the rest), ``merge`` keeps the table sorted; compiled too."""
    import numpy as np

    import importlib.util

    from wrapopt.cost import step as steploop

    fns = [(steploop.lookup, steploop.merge)]
    if importlib.util.find_spec("numba") is not None:
        compiled = steploop.compile_kernels()
        fns.append((compiled.lookup, compiled.merge))
    for lookup, merge in fns:
        keys, values = np.array([2.0, 8.0, 32.0]), np.array([0.2, 0.8, 3.2])
        out, missing = lookup(keys, values, np.array([8.0, 2.0, 8.0, 32.0]))
        assert missing == 0 and out.tolist() == [0.8, 0.2, 0.8, 3.2]
        out, missing = lookup(keys, values, np.array([1.0, 8.0, 64.0, 5.0]))
        assert missing == 3 and out[1] == 0.8 and np.isnan(out[[0, 2, 3]]).all()
        keys, values = merge(keys, values, np.array([1.0, 5.0, 64.0]), np.array([0.1, 0.5, 6.4]))
        assert keys.tolist() == [1.0, 2.0, 5.0, 8.0, 32.0, 64.0] and values.tolist() == [0.1, 0.2, 0.5, 0.8, 3.2, 6.4]
        assert lookup(np.zeros(0), np.zeros(0), np.array([1.0]))[1] == 1


def _layout_values(lay):
    """A layout as plain values, whichever builder made it (numpy arrays or tuples)."""
    py = lambda c: tuple(c.tolist()) if hasattr(c, "tolist") else tuple(c)  # noqa: E731
    return (lay.counts.tolist(), lay.times.tolist(), tuple(map(py, lay.seg_cols)), tuple(map(py, lay.unit_cols)))


def test_layout_kernel_matches_the_fragment_path():
    """See [Note: layout kernel]: ``layout_kernel`` (run here as Python, as numba compiles
    it) builds exactly the layout of the fragment path, on zoo models cut into
    sub-block units and on fixture models with a layer called three times, frozen
    weights, routed experts and modules that never run; random units, nested in one
    another too."""
    import torch

    from tests.fixtures_models import DIM, AlbertLike, LoRAModel, MoEModel, WithUnused, moe_inputs
    from wrapopt.cost.kernels import layout_kernel
    from wrapopt.cost.layout import Layouts
    from wrapopt.cost.step import Backend
    from wrapopt.search.study.space import SearchSpace

    graphs = [trace_model(*zoo.build(name, "meta")) for name in ("t5-tiny", "gpt-tiny")]
    graphs += [trace_model(AlbertLike(num_repeats=3), torch.randn(4, DIM)), trace_model(LoRAModel(), torch.randn(4, DIM)),
               trace_model(MoEModel(dense=True), moe_inputs()), trace_model(WithUnused(), torch.randn(4, DIM))]
    rng = random.Random(0)
    checked = 0
    for g in graphs:
        mesh = MeshSpec(world_size=16, ranks_per_node=4, shard_size=16)
        plans = [p.units for p in baselines(g, mesh).values()]
        if g.blocks:
            src = _Random(2)
            plans += [SearchSpace(g, mesh).decode(src).units for _ in range(15)]
        names = [m.fqn for m in g.modules if m.fqn]
        for _ in range(15):  # any modules, one or several to a unit (not nested within one unit, as legal plans)
            units: list[list[str]] = []
            for m in rng.sample(names, rng.randint(1, len(names))):
                u = units[-1] if units and len(units[-1]) < rng.randint(1, 3) else None
                if u is None or any(m.startswith(o + ".") or o.startswith(m + ".") for o in u):
                    units.append([m])
                else:
                    u.append(m)
            plans.append(tuple(UnitSpec(tuple(u)) for u in units) + (UnitSpec(("",), False),))
        for opts in (SimOptions(), SimOptions(param_dtype_bytes=2, reduce_dtype_bytes=4, batch_scale=1.5)):
            layouts = Layouts(g, analytical_compute(), opts, backend=Backend("python"))  # build: the fragment path
            for units in plans:
                fragments = layouts.build(units)
                kernel = layouts._build_compiled(layout_kernel, units)
                assert _layout_values(kernel) == _layout_values(fragments), units
                assert kernel.segments == fragments.segments
                checked += 1
    assert checked > 300
    unknown = (UnitSpec(("no.such.module",)), UnitSpec(("",), False))
    assert layouts._build_compiled(layout_kernel, unknown) is None  # build() takes the fragment path


def test_import_does_not_load_numba():
    """See [Note: compiled step loop]: numba (~1 s to import) loads when the first plan
    is scored, so CLI commands and spawned ranks that never score one do not pay it
    (building a ``Simulator`` does not load it either)."""
    import subprocess
    import sys

    code = ("import sys, wrapopt, wrapopt.cost.simulate, wrapopt.cli\n"
            "from wrapopt.cost import Simulator\n"
            "from wrapopt.hardware.presets import analytical_compute, analytical_fabric\n"
            "from wrapopt.models import zoo\n"
            "from wrapopt.trace.meta import trace_model\n"
            "Simulator(trace_model(*zoo.build('gpt-tiny', 'meta')), analytical_fabric(world_size=2), analytical_compute())\n"
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
