"""Plans applied on 2 gloo ranks: meta-device initialisation after sharding,
mixed precision and explicit prefetch, and bad input failing on every rank
before any collective. The cases run in the shared spawn (See tests/ranks.py).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.ranks import (
    MESH2, TOL, batches, catch, init_weights, mean_over_ranks, plan_specs, reference, train, two_rank_case, zoo_graph,
)
from wrapopt.errors import PlanError, PlanMismatchError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import baselines, make_plan
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec

pytestmark = pytest.mark.multiprocess


@two_rank_case
def meta_cases(rank: int, world: int, tmp: str, out: dict) -> None:
    from wrapopt.debug import full_tensor
    from wrapopt.plan.apply import materialize_sharded

    for name, labels in (("gpt-tiny", ("per-block", "groups-of-2", "keep+ckpt")),
                         ("llama-tiny", ("per-block", "groups-of-2"))):
        e = zoo.get_entry(name)
        specs = plan_specs(zoo_graph(name), MeshSpec(world_size=world, ranks_per_node=world, shard_size=world))
        ref = reference(name)
        full, mine = batches(name, world, rank)
        ref_losses = [float(v) for v in train(copy.deepcopy(ref), full, e.loss)]
        for label in labels:
            model = e.build("meta")
            WrapPlan(spec=specs[label], model=model_fingerprint(model)).apply(model)
            torch.manual_seed(0)
            materialize_sharded(model, device="cpu", init_fn=init_weights)
            same_init = all(torch.equal(full_tensor(model, n), p) for n, p in ref.named_parameters())
            tied = name != "gpt-tiny" or model.lm_head.weight is model.wte.weight
            losses = mean_over_ranks(train(model, mine, e.loss), world)
            out[f"meta/{name}/{label}"] = {"same_init": same_init, "tied": tied, "losses": losses, "ref": ref_losses}
    llama = zoo.get_entry("llama-tiny").build("meta")
    out["meta/default-init-error"] = catch(lambda: materialize_sharded(llama, device="cpu"), PlanError)


@two_rank_case
def mixed_precision_case(rank: int, world: int, tmp: str, out: dict) -> None:
    e = zoo.get_entry("gpt-tiny")
    graph = zoo_graph("gpt-tiny")
    spec = make_plan(graph, MESH2, list(graph.blocks), forward_prefetch=1)
    ref = e.build("cpu", seed=0)
    plan = WrapPlan(spec=spec, model=model_fingerprint(ref),
                    mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    model = plan.apply(copy.deepcopy(ref))
    seen: list[torch.dtype] = []
    model.layers[0].attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
    full, mine = batches("gpt-tiny", world, rank)
    losses = mean_over_ranks(train(model, mine, e.loss), world)
    ref_losses = [float(v) for v in train(copy.deepcopy(ref), full, e.loss)]
    state = model.layers[0]._get_fsdp_state()
    out["mp"] = {"compute_dtype": str(seen[0]), "stored_dtype": str(model.layers[0].attn.q_proj.weight.dtype),
                 "losses": losses, "ref": ref_losses,
                 "prefetch": [len(getattr(model.layers[i]._get_fsdp_state(), "_states_to_forward_prefetch", []))
                              for i in range(4)] if hasattr(state, "_states_to_forward_prefetch") else None}


@two_rank_case
def error_cases(rank: int, world: int, tmp: str, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    e = zoo.get_entry("gpt-tiny")
    graph = zoo_graph("gpt-tiny")
    ref = e.build("cpu", seed=0)
    good = WrapPlan(spec=plan_specs(graph, MESH2)["per-block"], model=model_fingerprint(ref))
    newer = good.to_json() | {"format": "wrapopt.plan/2"}
    path = os.path.join(tmp, f"newer-{rank}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(newer, f)
    out["err/newer"] = catch(lambda: WrapPlan.load(path), PlanError)
    four = WrapPlan(spec=baselines(graph, MeshSpec(world_size=4, ranks_per_node=4, shard_size=4))["per-block"],
                    model=model_fingerprint(ref))
    out["err/world"] = catch(lambda: four.apply(e.build("cpu")), PlanError)
    missing = WrapPlan(spec=PlanSpec((UnitSpec(("layers.9",)), UnitSpec((ROOT,), False)), MESH2),
                       model=model_fingerprint(ref))
    out["err/missing-strict"] = catch(lambda: missing.apply(e.build("cpu")), PlanMismatchError)
    out["err/missing-names-only"] = catch(lambda: missing.apply(e.build("cpu"), strict=False), PlanError)
    llama = zoo.get_entry("llama-tiny").build("cpu")
    out["err/other-model"] = catch(lambda: good.apply(llama), PlanMismatchError)
    sharded = good.apply(e.build("cpu"))
    out["err/twice"] = catch(lambda: good.apply(sharded), PlanError)
    wrapped = FSDP(e.build("cpu"), device_id=torch.device("cpu"))
    out["err/fsdp1-wrapped"] = catch(lambda: good.apply(wrapped, strict=False), PlanError)
    no_shard = WrapPlan(spec=baselines(graph, MESH2)["no-shard"], model=model_fingerprint(ref))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    out["err/mesh-shape"] = catch(lambda: no_shard.apply(e.build("cpu"), mesh=flat), PlanError)
    dist.barrier()  # every rank got here: no bad input left a rank waiting in a collective
    out["err/barrier"] = True


# --- meta-device initialisation -----------------------------------------------------------------------


def test_meta_init_equals_unsharded_init_and_trains_alike(two_rank_cases):
    cases = {k: v for k, v in two_rank_cases[0].items() if k.startswith("meta/") and isinstance(v, dict)}
    assert len(cases) == 5
    for case, r in cases.items():
        assert r["same_init"], f"{case}: sharded init differs from the unsharded init"
        assert r["tied"], f"{case}: tied parameters came apart"
        assert r["losses"] == pytest.approx(r["ref"], abs=TOL), case
        assert r["ref"][0] != r["ref"][-1]  # it trained


def test_mixed_precision_and_explicit_prefetch_are_applied(two_rank_cases):
    mp = two_rank_cases[0]["mp"]
    assert mp["compute_dtype"] == "torch.bfloat16" and mp["stored_dtype"] == "torch.float32"
    assert mp["losses"] == pytest.approx(mp["ref"], rel=2e-2)  # bf16 compute: close, not equal
    if mp["prefetch"] is not None:  # FSDP2's private list of units to prefetch
        assert mp["prefetch"] == [1, 1, 1, 0]


def test_meta_init_default_needs_reset_parameters(two_rank_cases):
    msg = two_rank_cases[0]["meta/default-init-error"]
    assert msg and "reset_parameters" in msg and "norm" in msg and "init_fn" in msg


# --- bad input ---------------------------------------------------------------------------------------


def test_bad_input_fails_on_every_rank_before_any_collective(two_rank_cases):
    for r in two_rank_cases:
        assert r["err/barrier"]
        assert "newer" in r["err/newer"] and "wrapopt.plan/2" in r["err/newer"] and "format" in r["err/newer"]
        assert "4 ranks" in r["err/world"] and "has 2" in r["err/world"]
        assert "layers.9" in r["err/missing-strict"] and "strict=False" in r["err/missing-strict"]
        assert "layers.9" in r["err/missing-names-only"]
        assert "modules that differ" in r["err/other-model"] and "GPT" in r["err/other-model"]
        assert "already sharded" in r["err/twice"]
        assert "FSDP1" in r["err/fsdp1-wrapped"]
        assert "(2,)" in r["err/mesh-shape"] and "(2, 1)" in r["err/mesh-shape"]
