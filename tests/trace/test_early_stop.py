"""[Note: early stop] in wrapopt/trace/record.py: what non-reentrant checkpoint's recompute skips,
read from the traced forward, against the ops torch's recompute runs; and the simulator charging it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed._composable import checkpoint

from wrapopt.cost import Simulator
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.spec import MeshSpec, UnitSpec
from wrapopt.trace.meta import trace_model
from wrapopt.trace.ops import Recorder


def _backward_flops(model: torch.nn.Module, x: tuple) -> float:
    """FLOPs the backward of one step runs (the recompute of checkpointed modules included)."""
    loss = model(*x).float().pow(2).mean()
    rec = Recorder([""])
    rec.backward = True
    with rec:
        loss.backward()
    return rec.bwd_total


@pytest.mark.parametrize("name, block, last", [("llama-tiny", "layers.1", "layers.1.mlp.down_proj"),
                                               ("gpt-tiny", "layers.1", "layers.1.mlp.fc2")])
def test_recompute_skips_what_torch_skips(name, block, last):
    """The traced shares give exactly the FLOPs torch's recompute of a checkpointed block runs
    (backward FLOPs with the checkpoint less without): the block's forward less its MLP's
    last linear layer, whose input is the last tensor the block saves."""
    g = trace_model(*zoo.build(name, "meta"))
    info = {m.fqn: m for m in g.modules}
    share = dict(info[block].early_stop)
    assert share[last] == 1.0  # the last GEMM never reruns
    sub = [m for m in g.modules if m.fqn == block or m.fqn.startswith(block + ".")]
    expected = sum(m.fwd_flops * (1.0 - share.get(m.fqn, 0.0)) for m in sub)
    forward = sum(m.fwd_flops for m in sub)
    assert 0.6 * forward < expected < 0.9 * forward
    plain = _backward_flops(*zoo.build(name))
    model, x = zoo.build(name)
    checkpoint(model.get_submodule(block))
    assert _backward_flops(model, x) - plain == pytest.approx(expected, rel=1e-9)
    # A linear layer checkpointed alone reruns nothing: its input is saved before its matmul.
    assert dict(info[last].early_stop) == {last: 1.0}


def test_simulator_charges_the_recompute_up_to_the_early_stop():
    """A per-block plan with every block checkpointed costs its forward, backward and the
    blocks' forwards less the skipped GEMMs (llama-7b on the H100 preset: 84% of a block's
    forward is recomputed); the exact DP's chain figures agree."""
    from wrapopt.search.dp.chain import chain_costs

    g = trace_model(*zoo.build("llama-7b", "meta"))
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    sim = Simulator(g, analytical_fabric(world_size=8, ranks_per_node=8), analytical_compute())
    blocks = g.blocks
    units = tuple(UnitSpec((b,)) for b in blocks) + (UnitSpec(("",), False),)
    lay = sim.layout(units)
    fwd, rerun = lay.times[0][:len(blocks)], lay.times[4][:len(blocks)]
    assert all(0.75 * f < r < 0.9 * f for f, r in zip(fwd.tolist(), rerun.tolist()))
    plain = sim.simulate(_plan(units, mesh))
    ck = sim.simulate(_plan(tuple(dataclasses.replace(u, checkpoint=not u.is_root) for u in units), mesh))
    oh = sim.compute.checkpoint_overhead_s * len(blocks)
    assert ck.compute_s - plain.compute_s == pytest.approx(sum(rerun.tolist()) + oh, rel=1e-9)
    cc = chain_costs(sim, mesh, blocks, 1)
    assert cc.ck_F == tuple(rerun.tolist())


def _plan(units, mesh):
    from wrapopt.spec import PlanSpec

    return PlanSpec(units=units, mesh=mesh)
