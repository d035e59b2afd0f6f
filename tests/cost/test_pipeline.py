"""The pipeline cost model ([Note: pipeline stages]): torch's action order, the timeline,
in-flight memory, a pipeline plan through ``Simulator.simulate``."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from wrapopt.cost.pipeline import StageCost, held_moment, run_timeline, schedule_order, send_s, stage_units
from wrapopt.cost.simulate import Simulator
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.search.baselines import baselines
from wrapopt.search.pipeline import pipeline_plan
from wrapopt.search.stages import pipeline_layout
from wrapopt.spec import MeshSpec, PlanSpec
from wrapopt.spec.plan import PipelineSpec
from wrapopt.trace.meta import trace_model


def _schedules():
    """torch's schedules, imported when a test reads them (a second of dynamo and DTensor at
    collection otherwise, in every pytest process that collects this file)."""
    from torch.distributed.pipelining import schedules

    return schedules


def _stage(f: float, b: float, acts: float = 1.0, reduce_s: float = 0.0, first: float = 0.0) -> StageCost:
    return StageCost(fwd_s=f, bwd_s=b, first_extra_s=first, reduce_s=reduce_s, optim_s=0.0, static_bytes=0.0,
                     kept_bytes=0.0, activation_bytes=acts, transient_bytes=0.0, compute_s=f + b, mb_comm_s=0.0,
                     once_comm_s=0.0, send_bytes=0.0, estimate=None)  # type: ignore[arg-type]


def _torch(a) -> tuple[str, int, int]:
    kind = {"F": "F", "B": "B", "REDUCE_GRAD": "R"}[a.computation_type.value]
    return kind, a.stage_index, -1 if a.microbatch_index is None else a.microbatch_index


def test_gpipe_order_is_torchs():
    raw = _schedules().ScheduleGPipe._get_pipeline_order(SimpleNamespace(_num_stages=3, _n_microbatches=5))
    assert schedule_order("GPipe", 3, 3, 5) == tuple(tuple(_torch(a) for a in raw[r] if a) for r in range(3))


def test_interleaved_order_is_torchs():
    p, v, m = 2, 2, 4
    stub = SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m, number_of_rounds=m // p,
                           microbatches_per_round=p)
    sched = _schedules()
    cls = sched.ScheduleInterleaved1F1B
    want = tuple(tuple(_torch(a) for a in sched._add_reduce_grad(cls._calculate_single_rank_operations(stub, r), m)
                       if a) for r in range(p))
    assert schedule_order("Interleaved1F1B", p, p * v, m) == want
    assert {s for rank in want for _, s, _ in rank} == {0, 1, 2, 3}


def test_1f1b_order_follows_torchs_runtime():
    """warm-up p - r forwards (``Schedule1F1B._step_microbatches``), then B/F in turn; rank 0 also
    equals torch's ``_get_pipeline_order`` (its later ranks' forwards are numbered one too high)."""
    order = schedule_order("1F1B", 2, 2, 4)
    assert order[0] == (("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("F", 0, 3), ("B", 0, 2),
                        ("B", 0, 3), ("R", 0, -1))
    assert order[1] == (("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2), ("F", 1, 3),
                        ("B", 1, 3), ("R", 1, -1))
    raw = _schedules().Schedule1F1B._get_pipeline_order(SimpleNamespace(_num_stages=2, _n_microbatches=4))
    assert tuple(_torch(a) for a in raw[0] if a) == order[0]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 3)])
def test_1f1b_textbook_makespan_and_inflight(p, m):
    f, b = 1.0, 2.0
    tl = run_timeline(schedule_order("1F1B", p, p, m), [_stage(f, b) for _ in range(p)], (0.0,) * p)
    assert tl.makespan_s == pytest.approx((m + p - 1) * (f + b))
    # rank r holds at most p - r micro-batches' activations (its warm-up)
    assert [sum(x) for x in tl.inflight] == [min(m, p - r) for r in range(p)]


def test_gpipe_holds_every_microbatch_and_sends_add_per_hop():
    p, m, f, b, hop = 2, 4, 1.0, 2.0, 0.25
    tl = run_timeline(schedule_order("GPipe", p, p, m), [_stage(f, b) for _ in range(p)], (hop, 0.0))
    assert [sum(x) for x in tl.inflight] == [m, m]
    # GPipe with equal stages: (m + p - 1)(f + b), plus one send forward and one back on the critical path
    assert tl.makespan_s == pytest.approx((m + p - 1) * (f + b) + 2 * hop)


def test_reduce_grad_and_first_microbatch_extra_lengthen_the_step():
    p, m = 2, 4
    order = schedule_order("1F1B", p, p, m)
    plain = run_timeline(order, [_stage(1, 2) for _ in range(p)], (0.0, 0.0)).makespan_s
    tail = run_timeline(order, [_stage(1, 2, reduce_s=0.5) for _ in range(p)], (0.0, 0.0)).makespan_s
    first = run_timeline(order, [_stage(1, 2, first=0.3) for _ in range(p)], (0.0, 0.0)).makespan_s
    # the reduction after the last backward; the first forward's all-gathers on each stage of the critical path
    assert tail == pytest.approx(plain + 0.5) and first == pytest.approx(plain + p * 0.3)


def test_interleaved_runs_every_action_once():
    p, v, m = 2, 2, 4
    tl = run_timeline(schedule_order("Interleaved1F1B", p, p * v, m), [_stage(0.5, 1.0) for _ in range(p * v)],
                      (0.0,) * (p * v), record=True)
    fb = [(k, s, mb) for _r, k, s, mb, _a, _b in tl.events if k != "R"]
    assert sorted(fb) == sorted((k, s, i) for k in "FB" for s in range(p * v) for i in range(m))
    # less bubble than 1F1B on p stages of twice the work: (m + p - 1)(f + b) with f, b doubled
    assert tl.makespan_s < (m + p - 1) * 3.0


def test_send_is_latency_plus_bytes_over_bandwidth():
    fab = analytical_fabric(world_size=16, ranks_per_node=8)
    nbytes = 64 * 2**20
    intra, inter = fab.intra, fab.inter
    assert send_s(fab, nbytes, cross_nodes=False) == pytest.approx(
        intra.latency_s + nbytes / intra.bandwidth_bytes_per_s)
    assert send_s(fab, nbytes, cross_nodes=True) == pytest.approx(
        inter.latency_s + nbytes / min(intra.bandwidth_bytes_per_s, inter.bandwidth_bytes_per_s))


@pytest.fixture(scope="module")
def llama():
    model, x = zoo.build("llama-tiny", "meta")
    g = trace_model(model, x)
    sim = Simulator(g, analytical_fabric(world_size=4, ranks_per_node=4), analytical_compute())
    return g, sim


STAGES = (("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.3", "layers.4", "layers.5", "norm", "lm_head"))


def _pp_plan(g, schedule="1F1B", m=4):
    per_block = baselines(g, MeshSpec(world_size=2, ranks_per_node=2, shard_size=2))["per-block"]
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, pp_size=2)
    return PlanSpec(units=per_block.units, mesh=mesh, pipeline=PipelineSpec(stages=STAGES, schedule=schedule,
                                                                            microbatches=m))


def test_simulate_dispatches_pipeline_plans(llama):
    g, sim = llama
    est = sim.simulate(_pp_plan(g), record=True)
    assert est.step_s > 0 and est.peak_bytes > 0
    assert len(est.units) == len(_pp_plan(g).units)
    parts = dict(est.peak_breakdown)
    assert parts["accumulated_grads"] > 0  # unsynchronised gradients held across micro-batches
    assert est.peak_bytes == sum(parts.values())
    assert any(e.kind == "reduce_scatter" for e in est.timeline)


def test_every_forward_and_backward_pays_the_schedules_host_work(llama):
    """[Note: pipeline actions]: each rank runs m forwards and m backwards one after another."""
    g, sim = llama
    m = 4
    slow = Simulator(g, sim.fabric, replace(sim.compute, pipeline_action_s=1e-3))
    base, more = sim.simulate(_pp_plan(g, "1F1B", m)), slow.simulate(_pp_plan(g, "1F1B", m))
    assert more.step_s - base.step_s >= 2 * m * 1e-3 * (1 - 1e-9)
    assert more.peak_bytes == base.peak_bytes


def test_gpipe_holds_more_activations_than_1f1b(llama):
    g, sim = llama
    one = dict(sim.simulate(_pp_plan(g, "1F1B", 8)).peak_breakdown)["activations"]
    gp = dict(sim.simulate(_pp_plan(g, "GPipe", 8)).peak_breakdown)["activations"]
    assert gp > 2 * one


def test_plans_without_pipeline_unchanged(llama):
    g, sim = llama
    plan = baselines(g, MeshSpec(world_size=4, ranks_per_node=4, shard_size=4))["per-block"]
    fresh = Simulator(g, sim.fabric, sim.compute)
    sim.simulate(_pp_plan(g))  # scoring a pipeline plan first changes nothing for the others
    assert sim.simulate(plan) == fresh.simulate(plan)


def test_stage_sub_graph_holds_its_modules_only(llama):
    g, sim = llama
    opts = replace(sim.options, grad_accumulation=2)
    first = sim.for_stage(STAGES[0], first=True, last=False, options=opts).graph
    last = sim.for_stage(STAGES[1], first=False, last=True, options=opts).graph
    assert first.num_params + last.num_params == g.num_params
    assert first.loss_saved_bytes == 0 and last.loss_saved_bytes == g.loss_saved_bytes
    # the loss's backward gradients (logits-sized) are the last stage's only: on the first they put
    # the whole loss's gradients in its working set (fidelity_pp, 4 ranks: gpt-tiny's pp2 peaks 43% over)
    assert g.loss_grad_bytes > 0 and first.loss_grad_bytes == 0 and last.loss_grad_bytes == g.loss_grad_bytes
    assert first.root.output_bytes == g.info("layers.2").output_bytes
    assert first.blocks == ("layers.0", "layers.1", "layers.2")


def test_torchs_1f1b_ir_still_numbers_later_ranks_one_high():
    """Why 1F1B's order is built from its runtime: torch 2.13's ``Schedule1F1B._get_pipeline_order``
    gives the last rank forwards 1..m (no F0). When torch fixes it, the order can come from torch."""
    raw = _schedules().Schedule1F1B._get_pipeline_order(SimpleNamespace(_num_stages=2, _n_microbatches=4))
    forwards = [a.microbatch_index for a in raw[1] if a and a.computation_type.value == "F"]
    assert forwards == [1, 2, 3, 4]
    assert [mb for k, _s, mb in schedule_order("1F1B", 2, 2, 4)[1] if k == "F"] == [0, 1, 2, 3]


def test_units_gathered_by_a_backward_stay_gathered_until_the_next_forward():
    """torch's stage keeps a backward's all-gathered parameters until the next forward (no
    reshard after backward): a forward right after the stage's backward, and a backward right
    after another, skip their all-gathers ([Note: pipeline stages], units gathered across actions)."""
    p, m = 2, 4
    st = [replace(_stage(2.0, 3.0), fwd_gathered_s=1.0, bwd_gathered_s=2.5) for _ in range(p)]
    # 1F1B, last rank: F0 B0 F1 B1 F2 B2 F3 B3: every forward after the first follows a backward
    tl = run_timeline(schedule_order("1F1B", p, p, m), st, (0.0,) * p)
    assert tl.busy_s[1] == pytest.approx(2.0 + 3 * 1.0 + m * 3.0)
    assert tl.saved_s[1] == pytest.approx((3 * 1.0, 0.0))
    # GPipe: F0..F3 then B0..B3: every forward gathers; the backwards after the first do not
    tl = run_timeline(schedule_order("GPipe", p, p, m), st, (0.0,) * p)
    assert tl.busy_s[0] == pytest.approx(m * 2.0 + 3.0 + 3 * 2.5)
    assert tl.saved_s[0] == pytest.approx((0.0, 3 * 0.5))
    # without the figures (None) every action pays its all-gathers, as before
    tl = run_timeline(schedule_order("1F1B", p, p, m), [_stage(2.0, 3.0) for _ in range(p)], (0.0,) * p)
    assert tl.busy_s[1] == pytest.approx(m * 5.0)


@pytest.fixture(scope="module")
def llama_7b():
    model, x = zoo.build("llama-7b", "meta")
    g = trace_model(model, x)
    return g, Simulator(g, analytical_fabric(world_size=16, ranks_per_node=8), analytical_compute())


def test_units_held_gathered_from_a_backward_to_the_next_forward_are_in_the_peak(llama_7b):
    """1F1B, resharded units: torch's stage leaves a backward's units gathered until the stage's
    next forward (``reshard_after_backward=False``), so before that forward the stage holds all
    its resharded units' parameters gathered, beside the static state and the kept units
    ([Note: pipeline stages], the memory of units held gathered)."""
    g, sim = llama_7b
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=8, pp_size=2)
    plan = pipeline_plan(pipeline_layout(g), (16, 16), mesh, schedule="1F1B", microbatches=8, reshard=True,
                         checkpoint="all", tp_spec=None)
    est = sim.simulate(plan)
    parts = dict(est.peak_breakdown)
    cost = {u.name: c for u, c in zip(plan.units, est.units)}
    held = [sum(cost[u.name].param_bytes for u in units if u.reshard_after_forward is not False)
            for units in stage_units(plan)]
    static = parts["sharded_params"] + parts["optimizer_state"] + parts["accumulated_grads"]
    assert min(held) > 6 * 2**30  # 16 blocks of llama-7b, gathered in its bf16
    assert parts["unsharded_params"] >= min(held)
    assert est.peak_bytes >= static + min(held) and est.peak_bytes == sum(parts.values())


def test_held_moment_counts_a_backwards_units_until_the_stages_next_forward():
    p, m = 2, 4
    st = [replace(_stage(1.0, 1.0, acts=1.0), transient_bytes=3.0, gathered_bytes=10.0, transient_gathered_bytes=2.0)
          for _ in range(p)]
    one = schedule_order("1F1B", p, p, m)
    # last rank, F0 B0 F1 ...: at F1's start no micro-batch in flight, B0's units held, F1's transient
    # less the 2 it would gather itself
    assert held_moment(one[1], st) == (0.0, 10.0, 1.0)
    # first rank, F0 F1 B0 F2 ...: at F2's start one micro-batch in flight
    assert held_moment(one[0], st) == (1.0, 10.0, 1.0)
    # GPipe, F0..F3 B0 B1 ...: at B1's start three in flight (its own too) and B0's units
    assert held_moment(schedule_order("GPipe", p, p, m)[0], st) == (3.0, 10.0, 1.0)
    # nothing resharded, nothing held: the peak keeps its bound
    assert held_moment(one[0], [replace(s, gathered_bytes=0.0) for s in st]) == (0.0, 0.0, 0.0)


def test_a_microbatch_in_flight_holds_its_stages_output(llama):
    """[Note: a stage keeps its output]: torch's stage keeps each micro-batch's output until its backward;
    the last stage's is the logits, which a plain step frees once the loss has run."""
    from wrapopt.cost.pipeline import held_bytes, price_stage, stage_simulators

    g, sim = llama
    plan = _pp_plan(g, "GPipe", 4)
    views = stage_simulators(sim, plan)
    for s, (ssim, units) in enumerate(views):
        last = s == len(views) - 1
        st = price_stage(ssim, units, plan, last=last)
        scale = ssim.options.batch_scale
        kept_in = [max((ssim.graph.info(m).output_bytes for m in u.modules), default=0) * scale
                   if not u.is_root else 0 for u in units]
        saved = held_bytes(st.estimate, units, kept_in, ssim.graph.loss_saved_bytes * scale if last else 0.0)
        out = (g.root.output_bytes if last else g.info("layers.2").output_bytes) * scale
        assert st.activation_bytes == pytest.approx(saved + out)
        assert st.send_bytes == (0.0 if last else pytest.approx(out))
        # the transient is the plain step's peak less the saved activations: the output is not in it twice
        static = sum(v for k, v in st.estimate.peak_breakdown if k in ("sharded_params", "optimizer_state",
                                                                       "accumulated_grads"))
        assert st.transient_bytes == pytest.approx(max(0.0, st.estimate.peak_bytes - static - st.kept_bytes - saved))


def test_a_stage_holds_a_copy_of_a_tied_parameter_it_uses():
    """[Note: tied copies on stages]: gpt-tiny's head shares the embedding's weight; a last stage
    with the head and not the embedding holds a copy (parameters, gradients, optimizer state)."""
    from wrapopt.cost.stage_view import stage_graph

    model, x = zoo.build("gpt-tiny", "meta")
    g = trace_model(model, x)
    (weight,) = [s for s in g.param_shapes if s[0] == "wte.weight"]
    numel = weight[1][0] * weight[1][1]
    assert g.info("lm_head").own_numel == 0  # the model counts it once, at the embedding
    first = stage_graph(g, ("wte", "wpe", "layers.0", "layers.1"), first=True, last=False)
    last = stage_graph(g, ("layers.2", "layers.3", "ln_f", "lm_head"), first=False, last=True)
    assert last.info("lm_head").own_numel == last.info("lm_head").own_trainable_numel == numel
    assert ("lm_head.weight", weight[1], weight[2]) in last.param_shapes
    assert first.num_params + last.num_params == g.num_params + numel
    both = stage_graph(g, ("wte", "wpe", "layers.0", "layers.1", "layers.2", "layers.3", "ln_f", "lm_head"),
                       first=True, last=True)
    assert both.num_params == g.num_params and both.info("lm_head").own_numel == 0
    assert both.tied_groups == (("wte.weight", "lm_head.weight"),)
