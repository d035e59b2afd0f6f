"""A tensor-parallel rank priced on what it runs (cost/tp.py): its own matmul shapes ([Note: split
matmuls]), the sequence-parallel backward's collectives ([Note: sequence parallel costs]), the
simulator's knobs in the view, and what async TP fuses ([Note: async tensor parallel])."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from wrapopt import zoo
from wrapopt.cost.calls import module_time
from wrapopt.cost.simulate import Simulator
from wrapopt.cost.tp import split_matmuls, tp_roles, tp_view
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.spec import SimOptions
from wrapopt.tp import builtin_tp_plan
from wrapopt.trace import trace_model

Q, DOWN = "layers.0.self_attn.q_proj", "layers.0.mlp.down_proj"


def _graph(name):
    model, x = zoo.build(name, "meta")
    return trace_model(model, x)


@pytest.fixture(scope="module")
def llama():
    return _graph("llama-tiny")


def _sp(graph, **kw):
    return replace(builtin_tp_plan(graph), sequence_parallel=True, loss_parallel=True, **kw)


def _measured(graph, compute):
    """``compute`` with every module measured at 1 ms forward, 2 ms backward (no roofline)."""
    return replace(compute, module_times=tuple((m.fqn, 1e-3, 2e-3) for m in graph.modules), batch_fixed_share=0.0)


def test_a_split_projection_runs_its_ranks_own_shapes(llama):
    spec = builtin_tp_plan(llama)
    roles = tp_roles(llama, spec)
    tokens = llama.batch_size * llama.seq_len
    n_q, k_q = next(s for f, s, _ in llama.param_shapes if f == Q + ".weight")
    n_d, k_d = next(s for f, s, _ in llama.param_shapes if f == DOWN + ".weight")
    table = split_matmuls(llama, roles, 2, batch_scale=4.0)
    # colwise: the input read whole, half of the weight and of the output
    assert table[Q] == ((2.0 * tokens * k_q * n_q / 2, tokens * k_q + k_q * n_q // 2 + tokens * n_q // 2, 4,
                         math.ceil(4 * tokens / 128) * math.ceil(n_q / 2 / 128), 1),)
    # rowwise: half of the input and of the weight, the output (a partial sum) whole
    assert table[DOWN] == ((2.0 * tokens * k_d * n_d / 2, tokens * k_d // 2 + k_d // 2 * n_d + tokens * n_d, 4,
                            math.ceil(4 * tokens / 128) * math.ceil(n_d / 128), 1),)
    fabric, compute = analytical_fabric(world_size=8), analytical_compute()
    _, comp, notes = tp_view(llama, compute, fabric, spec, 2)
    assert not any("no split efficiency" in n for n in notes)  # priced on the shapes, not assumed
    q0 = llama.info(Q)
    own = replace(q0, matmuls=split_matmuls(llama, roles, 2)[Q], fwd_flops=q0.fwd_flops / 2,
                  bwd_flops=q0.bwd_flops / 2, fwd_bytes=q0.fwd_bytes // 2, bwd_bytes=q0.bwd_bytes // 2)
    times = {f: (a, b) for f, a, b in comp.module_times}
    assert times[Q][0] == pytest.approx(module_time(own, compute, 1.0, {})[0], rel=1e-9)  # no forward collective
    assert times[Q][0] > module_time(q0, compute, 1.0, {})[0] / 2  # the whole input is read by each rank
    # a measured profile has no shapes to price: its times are divided, and the estimate says so
    _, _, notes = tp_view(llama, _measured(llama, compute), fabric, spec, 2)
    assert any("no split efficiency" in n for n in notes)


def test_sequence_parallel_backward_is_two_all_gathers_and_two_reduce_scatters(llama):
    """As torch's CommDebugMode counts them (tests/plan/test_tp_ranks.py): q, k, v (gate, up) input
    gradients are Partial sums, reduce-scattered once by their region, no all-reduce of their own."""
    fabric = analytical_fabric(world_size=8)
    compute = _measured(llama, analytical_compute())
    _, comp, _ = tp_view(llama, compute, fabric, _sp(llama), 2)
    times = {f: (a, b) for f, a, b in comp.module_times}
    block = [f for f in times if f == "layers.0" or f.startswith("layers.0.")]
    for name in ("q_proj", "k_proj", "v_proj"):
        assert times[f"layers.0.self_attn.{name}"][1] == pytest.approx(1e-3)  # 2 ms / 2 ranks: compute alone
    attn, o = llama.info("layers.0.self_attn"), llama.info("layers.0.self_attn.o_proj")
    mlp, down = llama.info("layers.0.mlp"), llama.info(DOWN)
    norm = llama.info("layers.0.input_layernorm")

    def c(kind, nbytes):
        return fabric.collective_s(kind, 2, 2, nbytes)[0]

    want = (c("reduce_scatter", attn.input_bytes) + c("all_gather", o.output_bytes)
            + c("reduce_scatter", mlp.input_bytes) + c("all_gather", down.output_bytes)
            + 2 * c("all_reduce", norm.own_bytes))  # + the norms' weights' partial gradients
    assert sum(times[f][1] for f in block) - 1e-3 * len(block) == pytest.approx(want, rel=1e-9)


def test_the_view_times_modules_as_the_simulator_does(llama):
    """Compile's fusions (and float8's casts) are in the simulator's graph, not the traced one: a
    2-D plan's modules are timed on the former, as a 1-D plan's are."""
    fabric, spec, norm = analytical_fabric(world_size=8), builtin_tp_plan(llama), "layers.0.input_layernorm"
    got = {}
    for on in (False, True):
        sim = Simulator(llama, fabric, analytical_compute(), SimOptions(compile=on))
        view = sim.for_tp(spec, 2)[0]
        scale = view.options.batch_scale
        got[on] = {f: a for f, a, _ in view.compute.module_times}[norm]
        assert got[on] == pytest.approx(module_time(sim.graph.info(norm), sim.compute, scale)[0] / scale, rel=1e-9)
    assert got[True] < got[False]


def test_async_tp_leaves_a_summed_gradients_reduce_scatter_exposed(llama):
    """torch's micro-pipeline pass fuses a reduce-scatter only with the matmul that makes its input:
    a region of several colwise projections reduce-scatters their sum (an add) unfused."""
    gpu, fabric = analytical_compute("h100-sxm"), analytical_fabric("h100-sxm+ib400", world_size=16)
    gpt = _graph("gpt-tiny")
    for graph, region, one in ((llama, "layers.0.self_attn", False), (gpt, "layers.0.mlp", True)):
        spec = _sp(graph)
        sync = {f: (a, b) for f, a, b in tp_view(graph, gpu, fabric, spec, 2)[1].module_times}
        both = {f: (a, b) for f, a, b in tp_view(graph, gpu, fabric, replace(spec, async_tp=True), 2)[1].module_times}
        assert both[region][0] < sync[region][0]  # forward: the all-gather fused with the colwise matmuls
        if one:  # one colwise projection (GPT's fc1): its input gradient's matmul makes the reduce-scatter's input
            assert both[region][1] < sync[region][1]
        else:
            assert both[region][1] == pytest.approx(sync[region][1], rel=1e-12)


def test_async_tp_pays_the_fused_ops_memory_pass(llama):
    """A fused matmul + reduce-scatter ends by summing the stacked partials (the whole output read,
    1/tp written) on the compute stream; NCCL's reduce-scatter did that inside the collective."""
    gpu, fabric = analytical_compute("h100-sxm"), analytical_fabric("h100-sxm+ib400", world_size=16)
    spec, o = _sp(llama), llama.info("layers.0.self_attn.o_proj")
    sync = {f: a for f, a, _ in tp_view(llama, gpu, fabric, spec, 2)[1].module_times}[o.fqn]
    both = {f: a for f, a, _ in tp_view(llama, gpu, fabric, replace(spec, async_tp=True), 2)[1].module_times}[o.fqn]
    rs = fabric.collective_s("reduce_scatter", 2, 2, o.output_bytes)[0]
    mm = sync - rs  # the projection's own forward
    summed = o.output_bytes * 1.5 / gpu.op_bandwidth_bytes_per_s
    assert both == pytest.approx(mm + max(rs - mm, 0.0) + min(rs, mm) / 2 + summed, rel=1e-9)
