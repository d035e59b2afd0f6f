"""The tensor-parallel view (cost/tp.py) and the 2-D search (search/tp.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from wrapopt import zoo
from wrapopt.cost.simulate import Simulator
from wrapopt.cost.tp import tp_view
from wrapopt.errors import OptionError, PlanError
from wrapopt.cost.calls import module_time
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.search.baselines import baselines
from wrapopt.search.driver import SearchOptions
from wrapopt.search.tp import resolve_tp, search_tp
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.tp import builtin_tp_plan
from wrapopt.trace import trace_model


@pytest.fixture(scope="module")
def llama():
    model, x = zoo.build("llama-tiny", "meta")
    return trace_model(model, x)


def _numel(graph, fqn):
    return next(math.prod(s) for f, s, _ in graph.param_shapes if f == fqn)


def test_view_splits_what_tp_splits(llama):
    spec = builtin_tp_plan(llama)
    fabric = analytical_fabric(world_size=8)
    # measured module times: divided by tp (a stated GPU prices the rank's own shapes: test_tp_split.py)
    compute = replace(analytical_compute(), module_times=tuple((m.fqn, 1e-3, 2e-3) for m in llama.modules),
                      batch_fixed_share=0.0)
    view, comp, notes = tp_view(llama, compute, fabric, spec, 2)
    assert any("no split efficiency" in n for n in notes)
    for name in ("layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"):
        assert _numel(view, name) * 2 == _numel(llama, name)
    for name in ("embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight"):
        assert _numel(view, name) == _numel(llama, name)
    split = sum(_numel(llama, f) for f, _, _ in llama.param_shapes if "_proj" in f)
    assert view.num_params == llama.num_params - split // 2
    q, o = view.info("layers.0.self_attn.q_proj"), view.info("layers.0.self_attn.o_proj")
    q0, o0 = llama.info("layers.0.self_attn.q_proj"), llama.info("layers.0.self_attn.o_proj")
    assert (q.fwd_flops * 2, q.output_bytes * 2, q.saved_bytes) == (q0.fwd_flops, q0.output_bytes, q0.saved_bytes)
    assert (o.saved_bytes * 2, o.output_bytes) == (o0.saved_bytes, o0.output_bytes)
    norm = view.info("layers.0.input_layernorm")
    assert norm == llama.info("layers.0.input_layernorm")  # replicated: unchanged
    # Time: the split modules take half, plus the block's all-reduces on the critical path.
    times = {f: (a, b) for f, a, b in comp.module_times}
    ar = fabric.collective_s("all_reduce", 2, 2, o0.output_bytes)[0]
    f0 = module_time(o0, compute, 1.0)[0]  # the whole module's measured time
    assert times["layers.0.self_attn.o_proj"][0] == pytest.approx(f0 / 2 + ar, rel=1e-9)
    b0 = module_time(q0, compute, 1.0)[1]
    ar_in = fabric.collective_s("all_reduce", 2, 2, q0.input_bytes)[0]
    assert times["layers.0.self_attn.q_proj"][1] == pytest.approx(b0 / 2 + ar_in, rel=1e-9)


def test_a_2d_plan_is_scored_on_its_data_parallel_mesh(llama):
    spec = builtin_tp_plan(llama)
    sim = Simulator(llama, analytical_fabric(world_size=8), analytical_compute())
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=4, tp_size=2)
    sub, _ = sim.for_tp(spec, 2)
    plan = baselines(sub.traced, mesh.data_parallel())["per-block"]
    est = sim.simulate(replace(plan, mesh=mesh, tp=spec))
    assert est == replace(sub.simulate(plan), notes=est.notes)
    parts = dict(est.peak_breakdown)
    assert parts["sharded_params"] == pytest.approx(sub.traced.param_bytes / 4, rel=1e-6)
    # the same global batch: one tensor-parallel group runs two ranks' batches
    assert sub.options.batch_scale == 2 * sim.options.batch_scale
    with pytest.raises(ValueError, match="TPSpec"):
        replace(plan, mesh=mesh)


def test_search_chooses_the_degree_with_the_units(llama):
    spec = builtin_tp_plan(llama)
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    sim = Simulator(llama, analytical_fabric(world_size=16), analytical_compute())
    res = search_tp(llama, sim, mesh, spec=spec, degrees=(1, 2), options=SearchOptions(trials=0))
    rows = dict(res.tp_rows)
    assert set(rows) == {"best 1-D", "best tp2", "TorchTitan default (tp2, one unit per block, checkpointed)"}
    assert rows["best tp2"].plan.mesh.tp_size == 2 and rows["best tp2"].plan.tp == spec
    assert rows["best 1-D"].plan.mesh == mesh or rows["best 1-D"].plan.mesh.tp_size == 1
    chosen = min((rows["best 1-D"], rows["best tp2"]), key=lambda s: s.estimate.step_s)
    assert res.best.estimate.step_s == chosen.estimate.step_s
    assert res.tp_chosen == res.best.plan.mesh.tp_size
    for s in res.candidates[:50]:  # every plan of the chosen degree is a whole 2-D plan
        assert s.plan.mesh.world_size == 16 and (s.plan.tp is not None) == (s.plan.mesh.tp_size > 1)
        assert sim.simulate(s.plan).step_s == s.estimate.step_s


def test_resolve_tp(llama):
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    def request(tp):
        return ParallelRequest(mesh=mesh, tp=tp)

    assert resolve_tp(llama, request(None))[0] == (1,)
    degrees, spec, notes = resolve_tp(llama, request("auto"))
    assert degrees == (1, 2) and spec is not None and not notes
    assert resolve_tp(llama, request(2))[0] == (2,)
    with pytest.raises(OptionError, match="--tp 3 does not divide the 8 GPUs per node"):
        request(3)
    with pytest.raises(PlanError, match="heads"):
        resolve_tp(llama, request(4))
    with pytest.raises(OptionError, match="auto or a positive integer"):
        request("two")


def test_tp_overhead_is_charged_per_split_projection_call(llama):
    spec = builtin_tp_plan(llama)
    fabric, compute = analytical_fabric(world_size=8), analytical_compute()
    plain = {f: (a, b) for f, a, b in tp_view(llama, compute, fabric, spec, 2)[1].module_times}
    slow = {f: (a, b) for f, a, b in tp_view(llama, replace(compute, tp_overhead_s=(1e-3, 2e-3)),
                                             fabric, spec, 2)[1].module_times}
    for f in plain:
        extra = (slow[f][0] - plain[f][0], slow[f][1] - plain[f][1])
        split = f.endswith("_proj")
        assert extra == pytest.approx((1e-3, 2e-3) if split else (0.0, 0.0), abs=1e-12), f

