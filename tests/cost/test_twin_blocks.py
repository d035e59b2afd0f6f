"""Twin modules of a block chain are priced alike ([Note: twin blocks] in wrapopt/cost/calls.py).

Issue 51: on a measured CPU profile one block's attention can read 10x its twins' (a 5-step median
on a shared CPU); the search then checkpointed the blocks that drew cheap forwards and kept the
others unsharded, predicted faster than per-block, and ran 12% slower.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.golden.estimates import _cpu_like
from wrapopt import MeshSpec, analytical_fabric, trace_model, zoo
from wrapopt.cost import Simulator
from wrapopt.cost.calls import twin_times
from wrapopt.search.baselines import baselines
from wrapopt.spec import PlanSpec

MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)


@pytest.fixture(scope="module")
def graph():
    e = zoo.get_entry("mha-tied")
    return trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss, fx=False)


def _measured(graph, slow: str, factor: float = 10.0):
    """A measured profile whose every module took 1 ms forward and 2 ms backward, ``slow`` ``factor`` times that."""
    def scale(m) -> float:  # a module never called measures zeros, as measure_module_times gives it
        return 0.0 if m.num_calls == 0 else factor if m.fqn == slow else 1.0

    times = tuple((m.fqn, 1e-3 * scale(m), 2e-3 * scale(m)) for m in graph.modules)
    return replace(_cpu_like(), module_times=times)


def _checkpoint_one(graph, i: int) -> PlanSpec:
    per_block = baselines(graph, MESH)["per-block"]
    units = tuple(replace(u, checkpoint=True) if k == i else u for k, u in enumerate(per_block.units))
    return PlanSpec(units, MESH, label=f"ckpt-{i}")


def test_twins_take_the_mean_and_the_total_stays(graph):
    comp = _measured(graph, "blocks.3.attn")
    pooled = dict((f, (a, b)) for f, a, b in twin_times(graph, comp).module_times)
    raw = dict((f, (a, b)) for f, a, b in comp.module_times)
    want = (1e-3 * (7 + 10) / 8, 2e-3 * (7 + 10) / 8)
    for i in range(8):
        assert pooled[f"blocks.{i}.attn"] == pytest.approx(want)
        assert pooled[f"blocks.{i}.mlp.0"] == raw[f"blocks.{i}.mlp.0"]
    assert pooled["lm_head"] == raw["lm_head"] and pooled["wte"] == raw["wte"]  # outside the blocks: as measured
    assert sum(a for a, _ in pooled.values()) == pytest.approx(sum(a for a, _ in raw.values()))
    assert sum(b for _, b in pooled.values()) == pytest.approx(sum(b for _, b in raw.values()))


def test_modules_that_differ_are_not_twins(graph):
    """Twins share the place in the block, class, FLOPs and sizes; a profile without module times is left as is."""
    comp = _measured(graph, "blocks.3.attn")
    pooled = dict((f, a) for f, a, _ in twin_times(graph, comp).module_times)
    assert pooled["blocks.3.ln1"] == pooled["blocks.3.ln2"] == 1e-3  # same shapes, another place in the block
    assert pooled["blocks.3.attn.out_proj"] == 0.0  # never called
    assert twin_times(graph, _cpu_like()) == _cpu_like()


def test_which_block_is_checkpointed_does_not_change_the_step(graph):
    """With one block measured slow, checkpointing any one block is predicted the same step (its
    recompute priced at the twins' mean), and per-block's step is as with the raw times."""
    comp = _measured(graph, "blocks.5.attn")
    sim = Simulator(graph, analytical_fabric(world_size=2, ranks_per_node=2), comp)
    steps = [sim.simulate(_checkpoint_one(graph, i)).step_s for i in range(8)]
    assert max(steps) - min(steps) <= 1e-9 * max(steps)
    # per-block's compute is the measured total, as before the pooling
    est = sim.simulate(baselines(graph, MESH)["per-block"])
    assert est.compute_s == pytest.approx(sum(a + b for _, a, b in comp.module_times) + comp.loss_s, rel=1e-9)


def test_the_search_does_not_follow_the_noise(graph):
    """The plan chosen under a tight budget is the same whichever block's attention read slow."""
    from wrapopt.search.driver import search_plan

    fabric = analytical_fabric(world_size=2, ranks_per_node=2)
    chosen = []
    for slow in ("blocks.1.attn", "blocks.6.attn"):
        sim = Simulator(graph, fabric, _measured(graph, slow))
        budget = 0.9 * sim.simulate(baselines(graph, MESH)["per-block"]).peak_bytes
        best = search_plan(graph, sim, MESH, memory_budget=budget).best
        chosen.append(([(u.modules, u.reshard_after_forward, u.checkpoint) for u in best.plan.units],
                       best.estimate.step_s))
    assert chosen[0][0] == chosen[1][0]
    assert chosen[0][1] == pytest.approx(chosen[1][1], rel=1e-12)
