"""The expert-parallel view (cost/ep.py): what one rank of an ep group holds, moves and computes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wrapopt import zoo
from wrapopt.cost.calls import module_time
from wrapopt.cost.ep import ep_problem, ep_view, expert_counts, expert_units, stacked_experts
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import PlanError
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec, Shape, SimOptions, UnitSpec
from wrapopt.trace import trace_model


@pytest.fixture(scope="module")
def moe():
    model, x = zoo.build("moe-tiny", "meta")
    return trace_model(model, x, fx=False)


def test_stacked_experts_are_found(moe):
    experts = stacked_experts(moe)
    assert sorted(experts) == [f"blocks.{i}.ffn" for i in range(4)]
    assert experts["blocks.0.ffn"] == (4, 2 * 4 * 64 * 128)  # w_in and w_out, 4 experts each
    assert expert_counts(moe) == (4,)
    assert ep_problem(moe, 2) is None and ep_problem(moe, 4) is None
    msg = ep_problem(moe, 3)
    assert "does not divide the 4 experts of blocks." in msg and "degrees that do: 2, 4" in msg
    dense = trace_model(*zoo.build("gpt-tiny", "meta"), fx=False)
    assert "no stacked experts" in ep_problem(dense, 2)


def test_view_gathers_a_rank_s_experts_and_stores_the_same_shard(moe):
    fabric, compute = analytical_fabric(world_size=8), analytical_compute()
    view, _c, notes = ep_view(moe, compute, fabric, 4)
    for fqn, (n, numel) in stacked_experts(moe).items():
        before, after = moe.info(fqn), view.info(fqn)
        assert before.own_numel - after.own_numel == numel - numel // 4  # gathers 1/4 of the experts
        assert after.own_bytes == before.own_bytes  # stores the whole stack's share of the shard group
        assert after.fwd_flops == before.fwd_flops  # runs as many (token, expert) pairs, balanced
        assert after.saved_bytes > before.saved_bytes  # the combine's weighting saves the tokens come back
    assert view.info("blocks.0.attn").own_numel == moe.info("blocks.0.attn").own_numel  # dense: unchanged
    assert view.num_params == moe.num_params and view.param_bytes == moe.param_bytes
    assert any("1x the mean on the busiest rank" in n for n in notes)  # the load imbalance, stated
    with pytest.raises(PlanError, match="does not divide the 4 experts"):
        ep_view(moe, compute, fabric, 3)


def _times(compute):
    return {f: (a, b) for f, a, b in compute.module_times}


def test_all_to_all_is_the_experts_time_and_crosses_nodes_past_a_node(moe):
    compute = analytical_compute()
    base = {m.fqn: module_time(m, compute, 1.0) for m in moe.call_order()}
    inside = _times(ep_view(moe, compute, analytical_fabric(world_size=16, ranks_per_node=8), 4)[1])
    across = _times(ep_view(moe, compute, analytical_fabric(world_size=16, ranks_per_node=2), 4)[1])
    skew = _times(ep_view(moe, compute, analytical_fabric(world_size=16, ranks_per_node=8), 4, imbalance=1.5)[1])
    fqn = "blocks.1.ffn"
    assert inside[fqn][0] > base[fqn][0] and inside[fqn][1] > base[fqn][1]  # dispatch + combine each way
    assert across[fqn][0] > inside[fqn][0]  # the ep group spans nodes: the slower link
    assert skew[fqn][0] - inside[fqn][0] == pytest.approx(0.5 * base[fqn][0])  # the busiest rank's share
    attn = "blocks.1.attn"
    assert inside[attn] == pytest.approx(base[attn])  # dense modules: as without expert parallelism


def test_simulate_scores_an_ep_plan_on_its_view(moe):
    sim = Simulator(moe, analytical_fabric(world_size=8), analytical_compute())
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    plan = baselines(moe, mesh)["per-block"]
    one = sim.simulate(plan)
    two = sim.simulate(replace(plan, mesh=replace(mesh, ep_size=2)))
    view = sim.view(Shape(ep=2)).simulate(plan)
    assert two.step_s == pytest.approx(view.step_s) and two.peak_bytes == view.peak_bytes
    assert two.step_s != one.step_s
    assert any("expert parallel 2" in n for n in two.notes)
    assert sim.view(Shape(ep=2)) is sim.view(Shape(ep=2))  # cached
    four = MeshSpec(world_size=4, ranks_per_node=4, shard_size=4, ep_size=4)
    whole = sim.simulate(replace(plan, mesh=four))  # efsdp 1: FSDP copies the experts, no collective
    units = expert_units(plan, tuple(stacked_experts(moe)))
    view = sim.for_ep(4)[0]
    costs = view._mesh_costs(view._unit_set(units.units, tuple((u.modules for u in units.units))), units.units,
                             four.data_parallel())
    assert list(costs.all_gather_s[:4]) == [0.0] * 4 and costs.all_gather_s[4] > 0  # experts' units: no collective
    assert costs.gathered_bytes[0] > 0  # but their copies held as gathered
    assert not any("efsdp" in n for n in whole.notes)
    eight = sim.simulate(replace(plan, mesh=replace(mesh, ep_size=2)))  # efsdp 4 of a shard group of 8: said
    assert any("efsdp = 4" in n for n in eight.notes)
    with pytest.raises((ValueError, PlanError)):
        sim.view(Shape(ep=2, tp=2))


def test_under_hsdp_a_rank_all_reduces_its_experts_shard_over_the_replicas(moe):
    """ep 2 inside shard groups of 2 of 8 ranks (efsdp 1): the experts' units gather nothing in the shard
    group, and all-reduce the rank's whole ``n/ep`` over the 4 replicas (a dense unit: its ``1/shard``)."""
    sim = Simulator(moe, analytical_fabric(world_size=8), analytical_compute())
    hsdp = MeshSpec(world_size=8, ranks_per_node=8, shard_size=2, ep_size=2)
    plan = baselines(moe, MeshSpec(world_size=8, ranks_per_node=8, shard_size=8))["per-block"]
    units = expert_units(plan, tuple(stacked_experts(moe)))
    view = sim.for_ep(2)[0]
    costs = view._mesh_costs(view._unit_set(units.units, tuple(u.modules for u in units.units)), units.units,
                             hsdp.data_parallel())
    gathered, grads, gather_s, _rs, all_reduce_s = costs.columns
    n = len(stacked_experts(moe))
    assert list(gather_s[:n]) == [0.0] * n and gather_s[n] > 0
    expert, dense = all_reduce_s[0], all_reduce_s[n]
    want = sim.fabric.collective_s("all_reduce", 4, 4, grads[0])[0]  # the rank's n/ep, efsdp 1
    assert expert == pytest.approx(want, rel=1e-6) and expert > 0
    assert dense == pytest.approx(sim.fabric.collective_s("all_reduce", 4, 4, grads[n] / 2)[0], rel=1e-6)
    est = sim.simulate(replace(plan, mesh=hsdp))
    assert est.step_s > 0 and any("expert parallel 2" in note for note in est.notes)


def test_experts_are_units_of_their_own(moe):
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    experts = tuple(stacked_experts(moe))
    plan = baselines(moe, mesh)["per-block"]
    split = expert_units(plan, experts)
    assert [u.modules for u in split.units[:4]] == [(e,) for e in experts]  # innermost first, resharding
    assert all(u.reshard_after_forward is True for u in split.units[:4]) and split.units[4:] == plan.units
    own = replace(plan, units=(UnitSpec((experts[0],), False), *plan.units))
    assert expert_units(own, experts).units[0] == UnitSpec((experts[0],), False)  # the plan's own unit kept
    held = replace(plan, units=(UnitSpec((experts[0], "blocks.0.ln2")), *plan.units[1:]))
    assert UnitSpec(("blocks.0.ln2",)) in expert_units(held, experts).units  # split out of the unit holding it
    assert expert_units(split, experts) == split
    ckpt = baselines(moe, mesh)["per-block,ckpt"]
    assert all(u.checkpoint is True for u in expert_units(ckpt, experts).units[:4])  # recomputed with the block


def test_the_view_keeps_the_step_s_knobs(moe):
    """An ep-1 view times every module as the simulator does (compile's fusions included): it adds only
    the permutations of the routed tokens."""
    sim = Simulator(moe, analytical_fabric(world_size=8), analytical_compute(), SimOptions(compile=True))
    plan = baselines(moe, MeshSpec(world_size=8, ranks_per_node=8, shard_size=8))["per-block"]
    plan = expert_units(plan, tuple(stacked_experts(moe)))  # the units the view scores
    base, one = sim.simulate(plan), sim.for_ep(1)[0].simulate(plan)
    eager = Simulator(moe, analytical_fabric(world_size=8), analytical_compute()).simulate(plan)
    assert base.step_s < eager.step_s  # compile prices faster: the view must keep that
    assert base.step_s < one.step_s < base.step_s * 1.01


def test_a_measured_experts_module_loops_over_a_rank_s_experts(moe):
    """Measured: the time beyond the matmuls' FLOPs is per-expert work, 1/ep of it; the matmuls whole."""
    base = analytical_compute()
    fqn = "blocks.0.ffn"
    m = moe.info(fqn)
    mm_f, mm_b = m.fwd_flops / base.flops_per_s, m.bwd_flops / base.flops_per_s
    measured = replace(base, module_times=tuple((x.fqn, 3 * mm_f if x.fqn == fqn else 1e-4,
                                                 3 * mm_b if x.fqn == fqn else 2e-4) for x in moe.call_order()))
    fabric = analytical_fabric(world_size=8)
    two = _times(ep_view(moe, measured, fabric, 2)[1])
    bare = replace(measured, module_times=tuple((f, mm_f, mm_b) if f == fqn else (f, a, b)
                                                for f, a, b in measured.module_times))  # matmuls alone
    plain = _times(ep_view(moe, bare, fabric, 2)[1])  # the matmuls, the all-to-alls and the permutes
    assert two[fqn][0] == pytest.approx(plain[fqn][0] + 2 * mm_f / 2)  # and half of the rest
    assert two[fqn][1] == pytest.approx(plain[fqn][1] + 2 * mm_b / 2)
    assert two["blocks.0.attn"] == pytest.approx((1e-4, 2e-4))  # dense: as measured


def test_a_pipeline_s_stages_are_cut_from_the_ep_view(moe):
    """pp 2 x ep 2 on 4 ranks (a stage's 2 data-parallel ranks, efsdp 1): each stage is priced on one
    ep rank's model, its experts' own units gathering nothing; a checkpointed block's experts unit keeps
    no input of its own (the block's is kept). See [Note: ep in a pipeline] in search/shapes.py."""
    from wrapopt.cost.pipeline import price_stage, stage_simulators
    from wrapopt.search.pipeline import pipeline_plan
    from wrapopt.search.stages import pipeline_layout

    sim = Simulator(moe, analytical_fabric(world_size=4), analytical_compute())
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, pp_size=2, ep_size=2)
    plan = pipeline_plan(pipeline_layout(moe), (2, 2), mesh, schedule="1F1B", microbatches=2, reshard=True,
                         checkpoint="all", tp_spec=None)
    est = sim.simulate(plan)
    dense = sim.simulate(replace(plan, mesh=replace(mesh, ep_size=1)))
    assert est.step_s != dense.step_s and any("expert parallel 2" in n for n in est.notes)
    view = sim.for_ep(2)[0]
    fixed = view._plan_fix(plan)
    experts = set(stacked_experts(moe))
    bare = stage_simulators(view, plan)  # the blocks alone, without the experts' own units
    for (ssim, units), (_s, whole) in zip(stage_simulators(view, fixed), bare):
        assert ssim._ep_alone == view._ep_alone  # the stage's experts priced as the view's
        stage = ssim.simulate(replace(fixed, units=units, mesh=fixed.mesh.data_parallel(), pipeline=None))
        own = [c for c, u in zip(stage.units, units) if set(u.modules) <= experts]
        assert own and all(c.all_gather_s == 0.0 for c in own)  # efsdp 1: no collective in the shard group
        assert all(u.checkpoint is True for u in units if not u.is_root)  # recomputed with their blocks
        # a checkpointed block's experts unit keeps no input of its own: the stage holds what the blocks hold
        assert price_stage(ssim, units, fixed, last=False).activation_bytes == pytest.approx(
            price_stage(ssim, whole, plan, last=False).activation_bytes)
