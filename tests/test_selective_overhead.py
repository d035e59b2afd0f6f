"""Selective-op's per-op cost (See [Note: selective checkpointing] in wrapopt/selective.py):
the tracer's op counts, the profile field, the simulator and the DP charging it per forward op
in forward and recompute, and its measurement: the arithmetic on recorded timings, the real timer
only for a finite figure (no speed is asserted)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.ranks import MESH2
from wrapopt.cost import Simulator
from wrapopt.hardware import measure_overheads
from wrapopt.hardware.measure_device import measure_selective_overhead
from wrapopt.hardware.presets import analytical_fabric
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.models import zoo
from wrapopt.search.baselines import baselines, checkpointed
from wrapopt.search.dp.chain import chain_costs, group_figures
from wrapopt.spec import SELECTIVE_OP
from wrapopt.trace.meta import trace_model

CPU = ComputeProfile(kind="measured", device="cpu", runs_ahead=False, flops_per_s=5e10,
                     memory_bandwidth_bytes_per_s=1e10, op_bandwidth_bytes_per_s=2e9)


@pytest.fixture(scope="module")
def llama():
    e = zoo.get_entry("llama-tiny")
    return trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)


def _block_ops(g, block):
    return sum(m.fwd_ops for m in g.modules if m.fqn == block or m.fqn.startswith(block + "."))


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _real_block_ops(block: str) -> int:
    """The ops a dispatch mode sees in one real CPU forward of llama-tiny's ``block``."""
    model, inputs = zoo.build("llama-tiny")
    mod = dict(model.named_modules())[block]
    captured = {}
    h = mod.register_forward_pre_hook(lambda _m, a, kw: captured.setdefault("c", (a, kw)), with_kwargs=True)
    with torch.no_grad():
        model(*inputs)
    h.remove()
    args, kwargs = captured["c"]
    count = _Count()
    with count:
        mod(*(a.detach().requires_grad_(a.is_floating_point()) for a in args), **kwargs)
    return count.ops


def test_the_tracer_counts_a_blocks_forward_ops_as_a_real_run_does(llama):
    """The meta trace's per-module op counts of a block add up to within 10% of the ops a
    dispatch mode sees in a real CPU forward of that block (what selective-op's modes see)."""
    block = llama.blocks[0]
    traced, real = _block_ops(llama, block), _real_block_ops(block)
    assert traced > 50 and abs(traced - real) <= 0.1 * real, (traced, real)


def test_the_profile_field_round_trips_and_old_files_read_zero(tmp_path):
    prof = dataclasses.replace(CPU, selective_op_overhead_s=1.25e-5)
    path = tmp_path / "compute.json"
    prof.save(str(path))
    assert ComputeProfile.load(str(path)).selective_op_overhead_s == 1.25e-5
    old = json.loads(path.read_text())
    del old["selective_op_overhead_s"]
    assert ComputeProfile.from_json(old).selective_op_overhead_s == 0.0


@pytest.mark.parametrize("backend", ("python", "compiled"))
def test_the_simulator_charges_each_forward_op_of_a_selective_unit_twice(llama, backend):
    """compute_s of per-block,sac grows by 2 x overhead x the blocks' forward ops (forward and
    recompute), in proportion to the overhead; none and full are unchanged; the step grows too."""
    base = baselines(llama, MESH2)["per-block"]
    plans = {mode: checkpointed(base, str(mode), mode) for mode in (False, True, SELECTIVE_OP)}
    ops = sum(_block_ops(llama, b) for b in llama.blocks)
    fab = analytical_fabric(world_size=2)
    est = {}
    for oh in (0.0, 1e-5, 2e-5):
        sim = Simulator(llama, fab, dataclasses.replace(CPU, selective_op_overhead_s=oh), backend=backend)
        est[oh] = {mode: sim.simulate(plan) for mode, plan in plans.items()}
    for oh in (1e-5, 2e-5):
        sel, sel0 = est[oh][SELECTIVE_OP], est[0.0][SELECTIVE_OP]
        assert sel.compute_s - sel0.compute_s == pytest.approx(2 * oh * ops, rel=1e-9)
        assert sel.fwd_s - sel0.fwd_s == pytest.approx(oh * ops, rel=1e-9)  # on CPU nothing hides it
        assert sel.step_s - sel0.step_s == pytest.approx(2 * oh * ops, rel=1e-9)
        for mode in (False, True):
            assert est[oh][mode].step_s == est[0.0][mode].step_s
    # at ~12 us per op (measured on this CPU) selective-op costs more than full checkpointing
    assert est[2e-5][SELECTIVE_OP].step_s > est[2e-5][True].step_s
    assert est[0.0][SELECTIVE_OP].step_s < est[0.0][True].step_s


def test_compiled_and_python_agree_with_the_overhead(llama):
    base = baselines(llama, MESH2)["per-block"]
    plan = checkpointed(base, "sac", SELECTIVE_OP)
    fab, cpu = analytical_fabric(world_size=2), dataclasses.replace(CPU, selective_op_overhead_s=1.3e-5)
    a = Simulator(llama, fab, cpu, backend="python").simulate(plan, record=True)
    b = Simulator(llama, fab, cpu, backend="compiled").simulate(plan, record=True)
    assert (a.peak_bytes, a.step_s, a.compute_s, a.timeline) == (b.peak_bytes, b.step_s, b.compute_s, b.timeline)


def test_the_dp_prices_a_selective_group_with_the_overhead(llama):
    """The DP's group figures add the overhead to forward and to backward (the recompute)."""
    fab = analytical_fabric(world_size=2)
    figs = []
    for oh in (0.0, 1e-5):
        sim = Simulator(llama, fab, dataclasses.replace(CPU, selective_op_overhead_s=oh))
        cc = chain_costs(sim, MESH2, llama.block_chains[0], max_group=2)
        figs.append(group_figures(cc, 0, 2, (True, SELECTIVE_OP)))
    ops = _block_ops(llama, llama.block_chains[0][0]) + _block_ops(llama, llama.block_chains[0][1])
    assert figs[1][0] - figs[0][0] == pytest.approx(1e-5 * ops, rel=1e-9)
    assert figs[1][1] - figs[0][1] == pytest.approx(1e-5 * ops, rel=1e-9)


def test_selective_overhead_is_the_timed_difference_per_forward_op_and_pass(llama, monkeypatch):
    """On recorded timings (no wall time): the block checkpointed through the selective modes
    less the block checkpointed fully, over twice the ops of one forward of the first block
    (forward and recompute each pay it); a selective run timed faster gives 0."""
    model, inputs = zoo.build("llama-tiny")
    ops = _real_block_ops(llama.blocks[0])  # layers.0: the model's first repeated block
    recorded = [2e-3, 2e-3 + 2 * ops * 1.5e-5]  # median seconds of the full and the selective run
    seen = []

    def timed(runs, repeats, sync):
        for run in runs:  # both checkpointed copies run forward and backward
            run()
        seen.append((len(runs), repeats))
        return list(recorded)

    monkeypatch.setattr(measure_overheads, "_interleaved", timed)
    assert measure_selective_overhead(model, inputs, repeats=3) == pytest.approx(1.5e-5, rel=1e-9)
    assert seen == [(2, 3)]  # the full and the selective copy, timed together
    recorded.reverse()
    assert measure_selective_overhead(model, inputs, repeats=3) == 0.0


def test_selective_overhead_measures_a_finite_figure_on_this_cpu():
    model, inputs = zoo.build("llama-tiny")
    got = measure_selective_overhead(model, inputs, repeats=1)
    assert got >= 0 and math.isfinite(got)  # floored at 0; no speed is asserted
