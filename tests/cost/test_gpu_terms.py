"""The cost-model terms the published GPU runs checked: memory-bound ops
([Note: memory-bound ops] in trace/op_bytes.py), per-call overhead under
batch_scale, and multi-rail rings ([Note: multi-rail rings] in hardware/profiles.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from wrapopt.cost import Simulator
from wrapopt.cost.layout import Layouts
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.trace.meta import trace_model
from wrapopt.spec import MeshSpec, SimOptions
from wrapopt.search.baselines import baselines


class _Ops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 16)
        self.lin = nn.Linear(16, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # reads 2 x its output, not the 1000-row table
        y = x.transpose(0, 1).reshape(-1)  # a copy: the transpose makes it non-contiguous
        z = x.view(-1) + 1.0  # a view (free) and an add (reads x, writes z)
        return self.lin(F.gelu(x)) + (y + z).view_as(x)


def _graph(batch: int = 4):
    model = _Ops()
    return trace_model(model, (torch.zeros(batch, 8, dtype=torch.long),), loss_fn=lambda o, _i: o.float().pow(2).mean(),
                       fx=False)


def test_memory_bound_bytes_per_module():
    g = _graph()
    n = 4 * 8 * 16 * 4  # one fp32 activation of the example
    assert g.info("emb").fwd_bytes == 2 * n  # the rows read and the output written
    assert g.info("lin").fwd_bytes == 0  # a matmul: FLOPs, taken as compute-bound
    # root: transpose copy (2n), add (2n), gelu (2n), y + z (3n), final add (3n), the loss's own ops
    assert g.root.fwd_bytes >= 12 * n
    assert sum(m.bwd_bytes for m in g.modules) > 0


def test_op_bandwidth_adds_time_and_zero_keeps_the_old_model():
    g = _graph()
    base = dataclasses.replace(analytical_compute(), op_bandwidth_bytes_per_s=0.0)
    slow = dataclasses.replace(base, op_bandwidth_bytes_per_s=1e9)
    t0 = Layouts(g, base, SimOptions()).build(
        baselines(g, MeshSpec(world_size=2, ranks_per_node=2, shard_size=2))["root-only"].units)
    t1 = Layouts(g, slow, SimOptions()).build(
        baselines(g, MeshSpec(world_size=2, ranks_per_node=2, shard_size=2))["root-only"].units)
    total = sum(m.fwd_bytes for m in g.modules)
    assert sum(t1.fwd_s) - sum(t0.fwd_s) == pytest.approx(total / 1e9)
    assert ComputeProfile.from_json(slow.to_json()).op_bandwidth_bytes_per_s == 1e9


def test_module_overhead_is_per_call_not_per_sample():
    g = _graph()
    comp = dataclasses.replace(analytical_compute(), flops_per_s=1e30, matmul_flops_per_s=0.0,
                               op_bandwidth_bytes_per_s=0.0, module_overhead_s=1e-3)
    units = baselines(g, MeshSpec(world_size=2, ranks_per_node=2, shard_size=2))["root-only"].units
    one = Layouts(g, comp, SimOptions(batch_scale=1.0)).build(units)
    many = Layouts(g, comp, SimOptions(batch_scale=64.0)).build(units)
    assert sum(many.fwd_s) == pytest.approx(sum(one.fwd_s))  # the overhead does not grow with the batch


def test_multi_rail_rings_use_every_nic_of_the_node():
    fab = analytical_fabric("a100-nvlink-ib200", world_size=64)
    nbytes = 1 << 30
    per_nic = fab.inter.bandwidth_bytes_per_s
    one_per_node, _ = fab.collective_s("all_gather", 8, 1, nbytes)  # HSDP's replicate axis: one NIC per ring
    full, _ = fab.collective_s("all_gather", 64, 8, nbytes)  # FSDP over 8 nodes: 8 NICs per node
    intra, _ = fab.collective_s("all_gather", 8, 8, nbytes)
    assert one_per_node == pytest.approx(7 * fab.inter.latency_s + 7 / 8 * nbytes / per_nic)
    assert full == pytest.approx(63 * fab.inter.latency_s
                                 + 63 / 64 * nbytes / min(8 * per_nic, fab.intra.bandwidth_bytes_per_s))
    assert intra < full < one_per_node
    # a node with one shared NIC (per-GPU share x 8 = the NIC) stays far slower than NVLink
    eth = analytical_fabric("h100-nvlink-eth100", world_size=64)
    assert eth.collective_s("all_gather", 64, 8, nbytes)[0] > 10 * eth.collective_s("all_gather", 8, 8, nbytes)[0]


def test_simulator_runs_with_the_new_terms():
    g = _graph()
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    est = Simulator(g, analytical_fabric(world_size=16), analytical_compute()).simulate(
        baselines(g, mesh)["every-leaf"])
    assert est.step_s > 0 and est.compute_s > 0
