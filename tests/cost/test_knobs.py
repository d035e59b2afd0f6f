"""float8 and torch.compile priced (issue 52): [Note: float8 costs] and [Note: compile costs] in cost/fused.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from wrapopt.cost import Simulator
from wrapopt.cost.fused import float8_linears, with_knobs
from wrapopt.cost.roofline import kernel_times
from wrapopt.errors import OptionError
from wrapopt.hardware.catalog import GPUS
from wrapopt.hardware.presets import analytical_compute, fabric_compute, pair_fabric
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec, SimOptions
from wrapopt.trace.meta import trace_model
from wrapopt.train import TrainConfig

D = 4096


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D, bias=False)  # eligible: N, K divisible by 16 and not small
        self.kv = nn.Linear(D, 1024, bias=False)  # tensorwise's auto filter: K <= 4096 and N <= 1024
        self.odd = nn.Linear(2 * D, D + 8, bias=False)  # N = 4104: not divisible by 16
        self.down = nn.Linear(D + 8, D, bias=False)  # K = 4104: not divisible by 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(torch.relu(self.odd(torch.relu(self.up(h))))) + self.kv(h).sum(-1, keepdim=True)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.output = nn.Linear(D, 8192, bias=False)  # the head: never converted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.output(x)


@pytest.fixture(scope="module")
def graph():
    model = _Model().to("meta")
    return trace_model(model, (torch.zeros(2, 1024, D, device="meta"),), loss_fn=lambda out, _x: out.float().sum())


def _sim(graph, gpu: str = "h100-sxm", **knobs):
    fab = pair_fabric(gpu, "ib400", world_size=8)
    opts = TrainConfig.preset("bf16", **knobs).sim_options()
    return Simulator(graph, fab, fabric_compute(fab, dtype="bfloat16"), opts)


def test_torchtitans_filter_skips_small_indivisible_and_the_head(graph):
    tensorwise = float8_linears(graph, "tensorwise")
    assert set(tensorwise) == {"layers.0.up", "layers.1.up"}
    assert tensorwise["layers.0.up"] == (2 * D, D)  # (N, K) of the weight
    rowwise = float8_linears(graph, "rowwise")  # kv: N <= 2048 is small for rowwise too
    assert "layers.0.kv" not in rowwise and "output" not in rowwise


def test_float8_gemms_run_at_the_fp8_rate_and_casts_move_bytes(graph):
    bf16, f8 = _sim(graph), _sim(graph, float8="tensorwise")
    m0 = next(m for m in bf16.graph.modules if m.fqn == "layers.0.up")
    m8 = next(m for m in f8.graph.modules if m.fqn == "layers.0.up")
    t0, t8 = kernel_times(m0, bf16.compute), kernel_times(m8, f8.compute)
    assert t0["GEMM fp8"] == (0.0, 0.0) and t8["GEMM"] == (0.0, 0.0)
    assert t8["GEMM fp8"][0] < 0.7 * t0["GEMM"][0]  # FP8 peak twice bf16's
    assert m8.fwd_bytes > m0.fwd_bytes and m8.bwd_bytes > m0.bwd_bytes  # amax, casts, transposed casts
    plan = baselines(graph, MeshSpec(world_size=8, ranks_per_node=8, shard_size=8))["per-block"]
    assert f8.simulate(plan).step_s < bf16.simulate(plan).step_s


def test_compile_fuses_memory_bound_ops_and_keeps_less(graph):
    eager, comp = _sim(graph), _sim(graph, compile=True)
    e = {m.fqn: m for m in eager.graph.modules}
    for m in comp.graph.modules:
        assert m.fwd_bytes <= e[m.fqn].fwd_bytes and m.saved_bytes <= e[m.fqn].saved_bytes
    assert sum(m.fwd_bytes for m in comp.graph.modules) < sum(m.fwd_bytes for m in eager.graph.modules)
    plan = baselines(graph, MeshSpec(world_size=8, ranks_per_node=8, shard_size=8))["per-block"]
    assert comp.simulate(plan).compute_s < eager.simulate(plan).compute_s


def test_float8_all_gather_moves_one_byte_per_eligible_element(graph):
    plan = baselines(graph, MeshSpec(world_size=8, ranks_per_node=8, shard_size=8))["per-block"]
    plain = _sim(graph, float8="tensorwise").simulate(plan).units
    gathered = _sim(graph, float8="tensorwise", float8_all_gather=True).simulate(plan).units
    share = sum(n * k for n, k in float8_linears(graph, "tensorwise").values()) / graph.num_params
    ratio = sum(u.param_bytes for u in gathered) / sum(u.param_bytes for u in plain)
    assert ratio == pytest.approx(1 - share / 2, rel=1e-6)


def test_float8_on_a_gpu_without_fp8_is_refused_in_one_line(graph):
    with pytest.raises(OptionError) as e:
        _sim(graph, gpu="a100-80gb-sxm", float8="rowwise")
    msg = str(e.value)
    assert "\n" not in msg and "a100-80gb-sxm" in msg and "tensorwise and rowwise" in msg


def test_hopper_presets_state_fp8_and_a100_none():
    h100 = GPUS["h100-sxm"]
    assert h100.datasheet.fp8_flops_per_s == pytest.approx(2 * h100.peak_flops_per_s["bfloat16"], rel=1e-3)  # 1,979
    assert GPUS["h200"].datasheet.fp8_flops_per_s > 0 and GPUS["a100-80gb-sxm"].datasheet.fp8_flops_per_s == 0
    p = GPUS["h100-hbm2e-500w"]
    nvl, sxm = GPUS["h100-nvl"].peak_flops_per_s["bfloat16"], GPUS["h100-sxm"].peak_flops_per_s["bfloat16"]
    assert nvl < p.peak_flops_per_s["bfloat16"] < sxm and p.hbm_bytes_per_s == 2.4e12
    assert p.memory_capacity_bytes == 96 * 2**30 and "Table 1" in p.fitted.knobs_fitted_on


def test_no_knob_leaves_the_graph_alone(graph):
    c = analytical_compute()
    g2, c2, share, notes = with_knobs(graph, c, SimOptions())
    assert g2 is graph and c2 is c and share == 0.0 and notes == ()
    assert dataclasses.replace(SimOptions(), compile=True).compile
