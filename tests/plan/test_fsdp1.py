"""FSDP1 through the plan's policy (plan/fsdp1.py): the policy alone, and FSDP1
training on 2 gloo ranks in the shared spawn (See tests/ranks.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.ranks import MESH2, TOL, batches, catch, mean_over_ranks, plan_specs, train, two_rank_case, zoo_graph
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import baselines, make_plan
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec

MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


@pytest.fixture
def per_block_plan(gpt_tiny) -> WrapPlan:
    model, _, graph = gpt_tiny
    return WrapPlan(spec=baselines(graph, MESH)["per-block"], model=model_fingerprint(model))


# --- the policy ------------------------------------------------------------------------------------


def test_fsdp1_policy_rejects_grouped_unit(gpt_tiny):
    model, _, graph = gpt_tiny
    spec = make_plan(graph, MESH, [("layers.0", "layers.1"), "layers.2", "layers.3"], label="grouped")
    plan = WrapPlan(spec=spec, model=model_fingerprint(model))
    with pytest.raises(PlanError, match=r"layers\.0"):
        plan.to_fsdp1_policy()


def test_fsdp1_policy_wraps_exactly_the_plan_modules(per_block_plan):
    model, _ = zoo.build("gpt-tiny", "meta")
    policy = per_block_plan.to_fsdp1_policy()
    assert policy(model, True, 0) is True  # FSDP1 first asks about the root with recurse=True
    wrapped = {name for name, m in model.named_modules() if name != ROOT and policy(m, False, 0)}
    assert wrapped == {"layers.0", "layers.1", "layers.2", "layers.3"}
    # recurse=True always descends.
    assert all(policy(m, True, 0) for _, m in model.named_modules())


def test_fsdp1_policy_names_missing_modules(per_block_plan):
    llama, _ = zoo.build("llama-tiny", "meta")
    wrong = WrapPlan(
        spec=PlanSpec(units=(UnitSpec(("layers.0",)), UnitSpec(("wte",)), UnitSpec((ROOT,), False)), mesh=MESH),
        model=per_block_plan.model,
    )
    with pytest.raises(PlanError, match="wte"):
        wrong.to_fsdp1_policy()(llama, True, 0)


def test_fsdp1_policy_maps_hpz_and_prefetch_with_a_warning(gpt_tiny):
    model, _, graph = gpt_tiny
    mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    spec = make_plan(graph, mesh, list(graph.blocks), reshard_after_forward=2, forward_prefetch=2)
    plan = WrapPlan(spec=spec, model=model_fingerprint(model),
                    mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": None})
    with pytest.warns(UserWarning, match="groups of N ranks") as caught:
        policy = plan.to_fsdp1_policy()
    text = " ".join(str(w.message) for w in caught)
    assert "prefetch depth 2 becomes 1" in text
    assert policy.root_kwargs["forward_prefetch"] is True
    assert policy.root_kwargs["mixed_precision"].param_dtype == torch.bfloat16
    assert all(kw["sharding_strategy"].name == "FULL_SHARD" for kw in policy.singles.values())
    hsdp = MeshSpec(world_size=16, ranks_per_node=8, shard_size=8)
    keep = WrapPlan(spec=make_plan(graph, hsdp, list(graph.blocks), reshard_after_forward=False), model=plan.model)
    with pytest.warns(UserWarning, match="device_mesh"):
        pol = keep.to_fsdp1_policy()
    assert {kw["sharding_strategy"].name for kw in pol.singles.values()} == {"_HYBRID_SHARD_ZERO2"}


# --- FSDP1 on 2 ranks -------------------------------------------------------------------------------


@two_rank_case
def fsdp1_cases(rank: int, world: int, tmp: str, out: dict) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from wrapopt.debug import full_tensor
    from wrapopt.fingerprint import strip_wrapper_prefixes

    e = zoo.get_entry("gpt-tiny")
    graph = zoo_graph("gpt-tiny")
    specs = plan_specs(graph, MESH2)
    specs["tied-group"] = make_plan(graph, MESH2, [*graph.blocks, ("wte", "lm_head")], label="tied")
    ref = e.build("cpu", seed=0)
    full, mine = batches("gpt-tiny", world, rank)
    ref_losses = [float(v) for v in train(copy.deepcopy(ref), full, e.loss)]
    for label, spec in specs.items():
        plan = WrapPlan(spec=spec, model=model_fingerprint(ref))
        grouped = any(len(u.modules) > 1 for u in spec.units)
        case: dict = {"ref": ref_losses}
        if grouped:
            case["unsplit"] = catch(plan.to_fsdp1_policy, PlanError)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            policy = plan.to_fsdp1_policy(split_groups=grouped)
            model = FSDP(copy.deepcopy(ref), auto_wrap_policy=policy, device_id=torch.device("cpu"),
                         **policy.root_kwargs)
        case["warnings"] = [str(w.message) for w in caught if str(w.message).startswith(("FSDP1 cannot", "FSDP1: "))]
        if any(u.checkpoint for u in spec.units):
            apply_activation_checkpointing(model, check_fn=plan.fsdp1_checkpoint_fn(model))
        case["wrapped"] = {strip_wrapper_prefixes(n): m.sharding_strategy.name for n, m in model.named_modules()
                           if isinstance(m, FSDP)}
        case["checkpointed"] = sorted(strip_wrapper_prefixes(n) for n, m in model.named_modules()
                                      if isinstance(m, CheckpointWrapper))
        case["losses"] = mean_over_ranks(train(model, mine, e.loss), world)
        case["full_shape"] = list(full_tensor(model, "layers.0.attn.q_proj.weight").shape)
        out[f"fsdp1/{label}"] = case
    four = WrapPlan(spec=baselines(graph, MeshSpec(world_size=4, ranks_per_node=4, shard_size=4))["per-block"],
                    model=model_fingerprint(ref))
    policy = four.to_fsdp1_policy()
    out["fsdp1/world"] = catch(lambda: FSDP(copy.deepcopy(ref), auto_wrap_policy=policy,
                                             device_id=torch.device("cpu")), PlanError)


@pytest.mark.multiprocess
def test_fsdp1_wraps_exactly_the_plan_units_and_trains_alike(two_rank_cases):
    r = two_rank_cases[0]
    blocks = {f"layers.{i}" for i in range(4)}
    for label in ("per-block", "keep+ckpt", "groups-of-2", "tied-group"):
        case = r[f"fsdp1/{label}"]
        assert set(case["wrapped"]) == blocks | {""}, label
        assert case["losses"] == pytest.approx(case["ref"], abs=TOL), label
        assert case["full_shape"] == [64, 64]
    assert r["fsdp1/per-block"]["warnings"] == []


@pytest.mark.multiprocess
def test_fsdp1_per_unit_arguments(two_rank_cases):
    r = two_rank_cases[0]
    assert set(r["fsdp1/per-block"]["wrapped"].values()) == {"FULL_SHARD"}
    kc = r["fsdp1/keep+ckpt"]
    assert all(kc["wrapped"][f"layers.{i}"] == "SHARD_GRAD_OP" for i in range(4))  # reshard_after_forward=False
    assert kc["checkpointed"] == [f"layers.{i}" for i in range(4)]
    assert any("apply_activation_checkpointing" in w for w in kc["warnings"])


@pytest.mark.multiprocess
def test_fsdp1_says_what_it_cannot_express(two_rank_cases):
    r = two_rank_cases[0]
    g2 = r["fsdp1/groups-of-2"]
    assert "layers.0 + layers.1" in g2["unsplit"] and "split_groups=True" in g2["unsplit"]
    assert any("one FSDP1 unit per module" in w for w in g2["warnings"])
    tied = r["fsdp1/tied-group"]
    assert any("wte + lm_head" in w and "shares parameters" in w for w in tied["warnings"])  # left to the root


@pytest.mark.multiprocess
def test_fsdp1_policy_checks_the_world_size_on_every_rank(two_rank_cases):
    for r in two_rank_cases:
        assert "4 ranks" in r["fsdp1/world"] and "has 2" in r["fsdp1/world"]
