"""search/choose.py: the simplest plan within the simulator's error, per-block by default."""

from __future__ import annotations

from dataclasses import replace

from tests.search.common import zoo_graph
from wrapopt.search.baselines import baselines, make_plan
from wrapopt.search.choose import MEMORY_ERROR, STEP_ERROR, choose, is_per_block
from wrapopt.search.strategy import Scored
from wrapopt.spec import CostEstimate, MeshSpec

MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
GiB = 2**30


def _scored(plan, step_s: float, peak: float) -> Scored:
    est = CostEstimate(step_s=step_s, fwd_s=0.0, bwd_s=0.0, compute_s=0.0, comm_s=0.0, exposed_comm_s=0.0,
                       peak_bytes=int(peak), peak_breakdown=(), units=())
    return Scored(plan, est, True)


def _plans():
    g = zoo_graph("gpt-tiny")
    base = baselines(g, MESH)
    pairs = make_plan(g, MESH, [list(g.blocks[:2]), list(g.blocks[2:])], label="pairs", reshard_after_forward=False)
    return g, base, pairs


def test_per_block_wins_within_the_error():
    g, base, pairs = _plans()
    per_block = _scored(base["per-block"], 1.0, 10 * GiB)
    faster = _scored(pairs, 1.0 / (1 + STEP_ERROR / 2), 20 * GiB)  # faster, but inside the error
    c = choose(g, [faster, per_block], 100 * GiB)
    assert c.best is per_block and c.fastest is faster
    assert c.why.startswith("per-block: nothing beats it") and f"{STEP_ERROR * 100:.1f}%" in c.why


def test_a_plan_beating_per_block_by_more_than_the_error_wins():
    g, base, pairs = _plans()
    per_block = _scored(base["per-block"], 1.0, 10 * GiB)
    faster = _scored(pairs, 0.9, 20 * GiB)
    c = choose(g, [per_block, faster], 100 * GiB)
    assert c.best is faster and c.per_block is per_block
    assert c.why.startswith("beats per-block by 11.1% (>")  # 1.0 / 0.9 - 1: the ratio the rule tests


def test_the_memory_margin_rules_out_a_plan_that_barely_fits():
    g, base, pairs = _plans()
    budget = 100 * GiB
    per_block = _scored(base["per-block"], 1.0, 10 * GiB)
    tight = _scored(pairs, 0.5, budget * (1 - MEMORY_ERROR / 2))  # fits, but within the memory model's error
    assert choose(g, [per_block, tight], budget).best is per_block


def test_no_more_checkpointing_than_needed():
    g, base, _ = _plans()
    per_block, ckpt = _scored(base["per-block"], 1.0, 30 * GiB), _scored(base["per-block,ckpt"], 1.2, 5 * GiB)
    assert choose(g, [ckpt, per_block], 100 * GiB).best is per_block
    # per-block does not keep the margin: the checkpointed cut is the per-block choice.
    c = choose(g, [ckpt, per_block], 31 * GiB)
    assert c.best is ckpt and c.why.startswith("per-block")
    assert is_per_block(g, ckpt.plan) and is_per_block(g, replace(per_block.plan, label="x"))


def test_without_per_block_the_simplest_near_the_fastest():
    g, base, pairs = _plans()
    root = _scored(base["root-only"], 1.0 + STEP_ERROR / 2, 50 * GiB)
    leaf = _scored(base["every-leaf"], 1.0, 10 * GiB)
    c = choose(g, [leaf, root, _scored(pairs, 2.0, 10 * GiB)], 100 * GiB)
    assert c.best is root and "no block" not in c.why and "per-block does not fit" in c.why
