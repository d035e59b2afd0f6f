"""Selective-op checkpointing (See [Note: selective checkpointing] in wrapopt/selective.py),
single-process: the plan file, the exports that refuse it, the simulator's view of it
against none and full checkpointing, and the search offering it. Training with it on
gloo ranks is in tests/plan/test_apply.py (parity) and tests/cost/test_memory_fidelity.py
(its peak against real steps)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from tests.ranks import MESH2
from wrapopt.cost import Simulator
from wrapopt.errors import OptionError, PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.interop import export_plan
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.plan.schema import schema_errors
from wrapopt.search.baselines import baselines, checkpointed
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.search.study.space import SearchSpace
from wrapopt.search.uniform import UniformGroupings
from wrapopt.selective import SAVED_OPS, is_saved_op, selective_policy
from wrapopt.spec import SELECTIVE_OP, UnitSpec
from wrapopt.trace.meta import trace_model

CPU = ComputeProfile(kind="measured", device="cpu", runs_ahead=False, flops_per_s=5e10,
                     memory_bandwidth_bytes_per_s=1e10, op_bandwidth_bytes_per_s=2e9)


@pytest.fixture(scope="module", params=("llama-tiny", "gpt-tiny"))
def traced(request):
    e = zoo.get_entry(request.param)
    return request.param, trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)


def _modes(graph):
    base = baselines(graph, MESH2)["per-block"]
    return {mode: checkpointed(base, str(mode), mode) for mode in (False, SELECTIVE_OP, True)}


def test_the_policy_is_torchtitans():
    """TorchTitan's per-op policy: compute-intensive ops, attention, amax and the collectives kept;
    mm every second one, counted per pass (forward and recompute apart); the rest recomputed."""
    from torch._functorch.partitioners import get_default_op_list
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    fwd, rec = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    policy = selective_policy()
    for op in (aten.addmm.default, aten.bmm.default, aten.max.default, aten._scaled_mm.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_efficient_attention.default,
               torch.ops._c10d_functional.reduce_scatter_tensor.default):
        assert is_saved_op(op) and policy(fwd, op) == save, op
    for op in (aten.gelu.default, aten.add.Tensor, aten.native_layer_norm.default, aten.silu.default, aten.abs.default):
        assert not is_saved_op(op) and policy(fwd, op) == again, op
    mm = aten.mm.default
    assert [policy(fwd, mm) for _ in range(3)] == [save, again, save]
    assert [policy(rec, mm) for _ in range(2)] == [save, again]  # the recompute counts on its own
    assert [selective_policy()(fwd, mm) for _ in range(2)] == [save, save]  # a fresh policy per region
    intensive = {op for op in get_default_op_list().compute_intensive_ops}
    assert intensive - SAVED_OPS == {aten.mm}


def test_the_tracer_records_what_selective_op_keeps(traced):
    """In each block every second mm is kept (1st, 3rd, ...) and the others recomputed; a biased
    Linear (addmm) always kept; a norm keeps nothing; a block keeps less than it saves for backward.
    What no op of the block reads but additions is the share compile drops."""
    name, g = traced
    block = g.blocks[0]
    inside = [m for m in g.modules if m.fqn.startswith(block + ".")]
    linears = [m for m in g.call_order() if m.fqn.startswith(block + ".") and m.cls == "Linear"]
    if name == "llama-tiny":  # no bias: mm, alternating
        assert [m.selective_kept_bytes == m.output_bytes for m in linears] == [i % 2 == 0 for i in range(len(linears))]
        assert [m.selective_mm_recompute for m in linears] == [float(i % 2) for i in range(len(linears))]
    else:  # biased: addmm, kept
        assert all(m.selective_kept_bytes == m.output_bytes and m.selective_mm_recompute == 0 for m in linears)
    # the last projection's sum is read by the next block only; gpt's attention output projection's by its norm
    assert [m.selective_unread for m in linears] == [0.0] * (len(linears) - 1) + [1.0]
    assert all(m.selective_kept_bytes == 0 for m in inside if "Norm" in m.cls)
    assert 0 < sum(m.selective_kept_bytes for m in inside) < sum(m.saved_bytes for m in inside)


def test_compile_keeps_what_backward_reads(traced):
    """[Note: compile keeps what backward reads]: compiled, a block's kept bytes lose the outputs
    only additions read, and nothing else."""
    from wrapopt.cost.fused import with_knobs
    from wrapopt.spec import SimOptions

    _name, g = traced
    g2 = with_knobs(g, analytical_compute(), SimOptions(compile=True))[0]
    before = {m.fqn: m for m in g.modules}
    for m in g2.modules:
        b = before[m.fqn]
        assert m.selective_kept_bytes == int(b.selective_kept_bytes * (1 - b.selective_unread)), m.fqn
    assert sum(m.selective_kept_bytes for m in g2.modules) < sum(m.selective_kept_bytes for m in g.modules)


@pytest.mark.parametrize("backend", ("python", "compiled"))
@pytest.mark.parametrize("compute", ("cpu", "gpu"))
def test_selective_op_lies_between_none_and_full(traced, backend, compute):
    """Peak: full < selective-op < none. Recompute (compute time beyond none's): 0 <
    selective-op's < full's. Both backends give the same numbers (next test)."""
    _name, g = traced
    sim = Simulator(g, analytical_fabric(world_size=2), CPU if compute == "cpu" else analytical_compute(),
                    backend=backend)
    est = {mode: sim.simulate(plan) for mode, plan in _modes(g).items()}
    none, sel, full = est[False], est[SELECTIVE_OP], est[True]
    assert full.peak_bytes < sel.peak_bytes < none.peak_bytes
    assert 0 < sel.compute_s - none.compute_s < full.compute_s - none.compute_s
    assert none.step_s < sel.step_s < full.step_s


def test_compiled_and_python_agree_on_selective_plans(traced):
    _name, g = traced
    fab = analytical_fabric(world_size=2)
    plans = _modes(g)
    base = plans[False]
    mixed = dataclasses.replace(base, units=tuple(
        u if u.is_root else UnitSpec(u.modules, i % 2 == 0, (False, SELECTIVE_OP, True)[i % 3])
        for i, u in enumerate(base.units)))
    for plan in (*plans.values(), mixed):
        a = Simulator(g, fab, CPU, backend="python").simulate(plan, record=True)
        b = Simulator(g, fab, CPU, backend="compiled").simulate(plan, record=True)
        assert (a.peak_bytes, a.step_s, a.compute_s) == (b.peak_bytes, b.step_s, b.compute_s), plan.label


def test_the_plan_file_round_trips_selective_op(tmp_path, traced):
    name, g = traced
    model = zoo.get_entry(name).build("meta")
    spec = _modes(g)[SELECTIVE_OP]
    plan = WrapPlan(spec=spec, model=model_fingerprint(model))
    data = plan.to_json()
    assert schema_errors(data) == []
    assert [u["checkpoint"] for u in data["units"]][:-1] == [SELECTIVE_OP] * len(g.blocks)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = WrapPlan.load(path)
    assert again.spec.units == spec.units
    # Full and none stay plain JSON booleans, as plan files always had them.
    full = WrapPlan(spec=_modes(g)[True], model=model_fingerprint(model)).to_json()
    assert {type(u["checkpoint"]) for u in full["units"]} == {bool}


def test_a_bad_checkpoint_value_is_refused_with_the_choices(traced):
    name, g = traced
    model = zoo.get_entry(name).build("meta")
    data = WrapPlan(spec=_modes(g)[SELECTIVE_OP], model=model_fingerprint(model)).to_json()
    data["units"][0]["checkpoint"] = "selective"
    with pytest.raises(PlanError, match="selective-op"):
        WrapPlan.from_json(json.loads(json.dumps(data)))
    with pytest.raises(OptionError, match="selective-op"):
        UnitSpec(("layers.0",), True, "selective")


def test_exports_that_cannot_express_it_refuse_naming_the_unit(traced):
    name, g = traced
    model = zoo.get_entry(name).build("meta")
    plan = WrapPlan(spec=_modes(g)[SELECTIVE_OP], model=model_fingerprint(model))
    first = g.blocks[0]
    with pytest.raises(PlanError, match=rf"unit '{first}'.*selective-op.*FSDP1"):
        plan.to_fsdp1_policy()
    for target in ("accelerate", "lightning-fsdp1"):  # checkpoint whole modules: full, listed as lost
        out = export_plan(plan, to=target)
        assert out.fields["selective_checkpoint"] == "lost"
        assert any("selective-op checkpointing" in x and "becomes full checkpointing" in x for x in out.losses)
    assert "apply" in export_plan(plan, to="lightning-fsdp2").text  # applies the plan itself: exact


def test_the_search_offers_selective_op_only_when_asked(traced):
    _name, g = traced
    space = SearchSpace(g, MESH2)
    assert not any("sac" in c for c in space.unit_choices)
    space = SearchSpace(g, MESH2, checkpoint_modes=(False, True, SELECTIVE_OP))
    assert {"T+sac", "F+sac", "node+sac"} <= set(space.unit_choices)
    plan = _modes(g)[SELECTIVE_OP]
    params = space.encode(plan)
    assert params is not None and space.from_params(params).units == plan.units
    sim = Simulator(g, analytical_fabric(world_size=2), analytical_compute())
    labels = {}
    for modes in ((False, True), (False, True, SELECTIVE_OP)):
        res = search_plan(g, sim, MESH2, options=SearchOptions(checkpoint_modes=modes))
        labels[modes] = {s.plan.label for s in res.candidates}
    assert not any("sac" in x or "ckpt-every" in x for x in labels[(False, True)])
    assert {"per-block,sac", "groups-of-2,sac", "per-block,ckpt-every-2", "per-block,ckpt-every-3"} <= labels[
        (False, True, SELECTIVE_OP)]
    assert UniformGroupings.name == "uniform"


def test_every_kth_block_checkpointing_marks_the_kth_blocks(traced):
    from wrapopt.search.uniform import every_kth_plan

    _name, g = traced
    plan = every_kth_plan(g, MESH2, 2, reshard=True)
    marks = [u.checkpoint for u in plan.units if not u.is_root]
    assert marks == [(j + 1) % 2 == 0 for j in range(len(g.blocks))]


def test_the_search_picks_selective_op_where_it_is_the_fastest_that_fits():
    """llama-7b on 8 GPUs under 60% of per-block's peak: with selective-op offered the
    answer is faster than without it, and checkpoints some units selectively."""
    e = zoo.get_entry("llama-7b")
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
    from wrapopt.spec import MeshSpec

    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    sim = Simulator(g, analytical_fabric(world_size=8, ranks_per_node=8), analytical_compute())
    budget = 0.6 * sim.simulate(baselines(g, mesh)["per-block"]).peak_bytes
    without = search_plan(g, sim, mesh, memory_budget=budget, options=SearchOptions()).best
    with_sac = search_plan(g, sim, mesh, memory_budget=budget,
                           options=SearchOptions(checkpoint_modes=(False, True, SELECTIVE_OP))).best
    assert with_sac.fits and with_sac.estimate.step_s < without.estimate.step_s
    assert any(u.selective_checkpoint for u in with_sac.plan.units)


def test_selective_op_under_an_output_dtype_cast_is_refused_before_any_collective():
    """See [Note: selective checkpointing under mixed precision] in wrapopt/selective.py."""
    from wrapopt.plan.apply import mixed_precision_policy
    from wrapopt.selective import cast_inputs_hook, check_selective_precision

    from wrapopt.trace.meta import trace_model

    e = zoo.get_entry("gpt-tiny")
    graph = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
    sac = checkpointed(baselines(graph, MESH2)["per-block"], "sac", "selective-op")
    with pytest.raises(PlanError, match="output_dtype"):
        check_selective_precision(sac, mixed_precision_policy({"param_dtype": "bfloat16", "output_dtype": "float32"}))
    check_selective_precision(sac, mixed_precision_policy({"param_dtype": "bfloat16"}))  # no output cast: fine
    args, kwargs = cast_inputs_hook(torch.bfloat16)(None, (torch.ones(2), torch.ones(2, dtype=torch.long)),
                                                     {"mask": torch.zeros(1)})
    assert (args[0].dtype, args[1].dtype, kwargs["mask"].dtype) == (torch.bfloat16, torch.long, torch.bfloat16)
