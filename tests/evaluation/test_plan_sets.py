"""The plan sets ``evaluate`` measures beside wrapopt's choice (wrapopt/evaluation/plan_sets.py)."""

from __future__ import annotations

import pytest

from tests.ranks import zoo_graph
from wrapopt.evaluation.evaluate import PLAN_SETS
from wrapopt.evaluation.evidence import BASELINES
from wrapopt.evaluation.plan_sets import uniform_sizes
from wrapopt.spec import MeshSpec
from wrapopt.units import validate_plan

MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)


def _chains(*lengths):
    return tuple(tuple(f"c{i}.{j}" for j in range(n)) for i, n in enumerate(lengths))


def test_uniform_sizes_divide_or_cover_each_chain():
    assert uniform_sizes(_chains(20)) == [1, 2, 3, 4, 5, 10, 20]
    assert uniform_sizes(_chains(6)) == [1, 2, 3, 4, 6]
    assert uniform_sizes(_chains(2, 3)) == [1, 2, 3]
    assert uniform_sizes(_chains(12, 12)) == [1, 2, 3, 4, 6, 12]
    assert uniform_sizes(()) == []


def by_label(plans, label):
    return next(p for p in plans if p.label == label)


def test_uniform_set_holds_every_grouping_with_each_choice_and_the_baselines():
    graph = zoo_graph("deep-narrow")
    plans = PLAN_SETS["uniform"](graph, MESH)
    labels = [p.label for p in plans]
    # The baselines first, under their names; uniform-1 is per-block and uniform-1,ckpt is
    # per-block,ckpt, so they are left out.
    assert labels[:len(BASELINES)] == list(BASELINES)
    # 7 sizes x (reshard on, off) x (no, full, selective-op checkpointing), less those two,
    # and one unit per block with every 2nd or 3rd block fully checkpointed.
    assert len(labels) == len(set(labels)) == len(BASELINES) + 7 * 6 - 2 + 2
    assert by_label(plans, "uniform-4,sac").units[0].checkpoint == "selective-op"
    marks = [u.checkpoint for u in by_label(plans, "per-block,ckpt-every-3").units[:-1]]
    assert marks == [(j + 1) % 3 == 0 for j in range(20)]
    assert "uniform-1" not in labels and "uniform-1,ckpt" not in labels
    keys = [(p.units, p.mesh, p.forward_prefetch) for p in plans]
    ours = keys[len(BASELINES):]  # (size-1e8 and root-only are one plan on a model this small)
    assert len(set(ours)) == len(ours) and not set(ours) & set(keys[:len(BASELINES)])
    by = {p.label: p for p in plans}
    assert len(by["uniform-3"].units) == 7 + 1  # 20 blocks in groups of 3: six of 3 and one of 2, and the root
    assert [len(u.modules) for u in by["uniform-3"].units[:-1]] == [3] * 6 + [2]
    assert len(by["uniform-20,keep,ckpt"].units) == 2
    u = by["uniform-5,keep,ckpt"].units[0]
    assert (u.reshard_after_forward, u.checkpoint) == (False, True)
    for p in plans:
        validate_plan(graph, p)


@pytest.mark.parametrize("name", ["tx-decoder", "gpt-tiny"])
def test_contenders_is_exhaustive_and_uniform_without_repeats(name):
    graph = zoo_graph(name)
    def keys(plans):
        return [(p.units, p.mesh, p.forward_prefetch) for p in plans]

    exhaustive, uniform = keys(PLAN_SETS["exhaustive"](graph, MESH)), keys(PLAN_SETS["uniform"](graph, MESH))
    plans = keys(PLAN_SETS["contenders"](graph, MESH))
    assert plans[:len(exhaustive)] == exhaustive
    added = plans[len(exhaustive):]
    assert added and len(set(added)) == len(added) and not set(added) & set(exhaustive)
    assert set(plans) == set(exhaustive) | set(uniform)
    # Two chains (encoder 2, decoder 3): groups of 3 cover the encoder in one group.
    if name == "tx-decoder":
        by = {p.label: p for p in PLAN_SETS["uniform"](graph, MESH)}
        assert [len(u.modules) for u in by["uniform-3"].units[:-1]] == [2, 3]
