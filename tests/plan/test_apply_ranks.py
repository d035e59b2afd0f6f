"""Plans in training code: the plan file's JSON schema, exports to Accelerate and
Lightning, meta-device initialisation after sharding, FSDP1 through the plan's
policy, the inspection helpers, bad input failing on every rank, and
``optimize_wrap`` under a process group.

Multi-process cases run in two spawns of 2 gloo ranks (each spawn costs
seconds): one for FSDP2/FSDP1/inspect/errors, one for ``optimize_wrap``.
Sharded training is compared with the unsharded model trained on the whole
batch: with a mean loss the averaged gradients are equal, so the losses
match step for step (fp32, no dropout).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.cli.export import add_export_parser, run_export
from wrapopt.errors import PlanError, PlanMismatchError
from wrapopt.fingerprint import model_fingerprint, module_classes
from wrapopt.interop.export import class_policy, export_plan
from wrapopt.launch import spawn
from wrapopt.models import zoo
from wrapopt.plan.file import PLAN_FORMAT, WrapPlan, plan_schema, schema_errors
from wrapopt.search.baselines import baselines, make_plan
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec

TOL = 1e-5
STEPS = 3
MESH2 = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)


# --- helpers shared by the workers (module level: spawn pickles them by name) ---------------------


def _graph(name: str):
    from wrapopt.trace.meta import trace_model

    e = zoo.get_entry(name)
    return trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)


def _specs(graph, mesh: MeshSpec) -> dict[str, PlanSpec]:
    b = baselines(graph, mesh)
    blocks = graph.blocks
    root = UnitSpec((ROOT,), False)
    return {
        "per-block": b["per-block"],
        "groups-of-2": PlanSpec(tuple(UnitSpec(blocks[i:i + 2]) for i in range(0, len(blocks), 2)) + (root,), mesh, label="g2"),
        "keep+ckpt": PlanSpec(tuple(UnitSpec((blk,), False, True) for blk in blocks) + (root,), mesh, label="kc"),
    }


def _init_weights(module: nn.Module) -> None:
    """One module's own parameters, as the examples initialise them."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif isinstance(module, zoo.RMSNorm):
        nn.init.ones_(module.weight)


def _retie(model: nn.Module) -> None:
    # to_empty() on a plain meta model gives each use of a tied parameter its own tensor;
    # re-tie as the model's constructor does (sharded models keep their ties, see the test).
    if isinstance(model, zoo.GPT):
        model.lm_head.weight = model.wte.weight


def _reference(name: str, seed: int = 0) -> nn.Module:
    """Built on meta, materialised, initialised module by module in named_modules() order."""
    model = zoo.get_entry(name).build("meta")
    model.to_empty(device="cpu")
    _retie(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, m in model.named_modules():
            _init_weights(m)
    return model


def _batches(name: str, world: int, rank: int):
    e = zoo.get_entry(name)
    full = [tuple(t.roll(s, dims=0) for t in e.inputs(batch=2 * world)) for s in range(STEPS)]
    mine = [tuple(t.chunk(world)[rank] for t in x) for x in full]
    return full, mine


def _train(model, batches, loss_fn) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in batches:
        loss = loss_fn(model(*x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _mean_over_ranks(losses, world) -> list[float]:
    t = torch.stack(losses)
    dist.all_reduce(t)
    return [float(v) for v in t / world]


def _catch(fn, *exc):
    try:
        fn()
    except exc as e:  # noqa: PERF203
        return f"{type(e).__name__}: {e}"
    return None


# --- worker 1: FSDP2 meta init, inspect, FSDP1, errors ----------------------------------------------


def _meta_cases(rank: int, world: int, out: dict) -> None:
    from wrapopt.debug import full_tensor
    from wrapopt.plan.apply import materialize_sharded

    for name, labels in (("gpt-tiny", ("per-block", "groups-of-2", "keep+ckpt")), ("llama-tiny", ("per-block", "groups-of-2"))):
        e = zoo.get_entry(name)
        specs = _specs(_graph(name), MeshSpec(world_size=world, ranks_per_node=world, shard_size=world))
        ref = _reference(name)
        full, mine = _batches(name, world, rank)
        ref_losses = [float(v) for v in _train(copy.deepcopy(ref), full, e.loss)]
        for label in labels:
            model = e.build("meta")
            WrapPlan(spec=specs[label], model=model_fingerprint(model)).apply(model)
            torch.manual_seed(0)
            materialize_sharded(model, device="cpu", init_fn=_init_weights)
            same_init = all(torch.equal(full_tensor(model, n), p) for n, p in ref.named_parameters())
            tied = name != "gpt-tiny" or model.lm_head.weight is model.wte.weight
            losses = _mean_over_ranks(_train(model, mine, e.loss), world)
            out[f"meta/{name}/{label}"] = {"same_init": same_init, "tied": tied, "losses": losses, "ref": ref_losses}
    llama = zoo.get_entry("llama-tiny").build("meta")
    out["meta/default-init-error"] = _catch(lambda: materialize_sharded(llama, device="cpu"), PlanError)


def _inspect_cases(rank: int, world: int, out: dict) -> None:
    from wrapopt.debug import full_tensor, memory_report
    from wrapopt.errors import WrapoptError

    e = zoo.get_entry("gpt-tiny")
    ref = e.build("cpu", seed=0)
    model = copy.deepcopy(ref)
    WrapPlan(spec=_specs(_graph("gpt-tiny"), MESH2)["per-block"], model=model_fingerprint(ref)).apply(model)
    out["inspect/q_proj"] = torch.equal(full_tensor(model, "layers.0.attn.q_proj.weight"), ref.layers[0].attn.q_proj.weight)
    out["inspect/tied"] = torch.equal(full_tensor(model, "lm_head.weight"), ref.wte.weight)
    out["inspect/typo"] = _catch(lambda: full_tensor(model, "layers.0.attn.q_prj.weight"), WrapoptError)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_one = e.loss(model(*e.inputs()), e.inputs())
    _train_one.backward()
    opt.step()
    report = memory_report(model, opt)
    bare = memory_report(model)
    unique_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    out["inspect/report"] = {"table": str(report), "json": report.to_json(), "unique_bytes": unique_bytes,
                             "bare_categories": list(bare.categories)}


def _fsdp1_cases(rank: int, world: int, out: dict) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from wrapopt.debug import full_tensor
    from wrapopt.fingerprint import strip_wrapper_prefixes

    e = zoo.get_entry("gpt-tiny")
    graph = _graph("gpt-tiny")
    specs = _specs(graph, MESH2)
    specs["tied-group"] = make_plan(graph, MESH2, [*graph.blocks, ("wte", "lm_head")], label="tied")
    ref = e.build("cpu", seed=0)
    full, mine = _batches("gpt-tiny", world, rank)
    ref_losses = [float(v) for v in _train(copy.deepcopy(ref), full, e.loss)]
    for label, spec in specs.items():
        plan = WrapPlan(spec=spec, model=model_fingerprint(ref))
        grouped = any(len(u.modules) > 1 for u in spec.units)
        case: dict = {"ref": ref_losses}
        if grouped:
            case["unsplit"] = _catch(plan.to_fsdp1_policy, PlanError)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            policy = plan.to_fsdp1_policy(split_groups=grouped)
            model = FSDP(copy.deepcopy(ref), auto_wrap_policy=policy, device_id=torch.device("cpu"), **policy.root_kwargs)
        case["warnings"] = [str(w.message) for w in caught if str(w.message).startswith(("FSDP1 cannot", "FSDP1: "))]
        if any(u.checkpoint for u in spec.units):
            apply_activation_checkpointing(model, check_fn=plan.fsdp1_checkpoint_fn(model))
        case["wrapped"] = {strip_wrapper_prefixes(n): m.sharding_strategy.name for n, m in model.named_modules()
                           if isinstance(m, FSDP)}
        case["checkpointed"] = sorted(strip_wrapper_prefixes(n) for n, m in model.named_modules()
                                      if isinstance(m, CheckpointWrapper))
        case["losses"] = _mean_over_ranks(_train(model, mine, e.loss), world)
        case["full_shape"] = list(full_tensor(model, "layers.0.attn.q_proj.weight").shape)
        out[f"fsdp1/{label}"] = case
    four = WrapPlan(spec=baselines(graph, MeshSpec(world_size=4, ranks_per_node=4, shard_size=4))["per-block"],
                    model=model_fingerprint(ref))
    policy = four.to_fsdp1_policy()
    out["fsdp1/world"] = _catch(lambda: FSDP(copy.deepcopy(ref), auto_wrap_policy=policy,
                                             device_id=torch.device("cpu")), PlanError)


def _error_cases(rank: int, world: int, tmp: str, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    e = zoo.get_entry("gpt-tiny")
    graph = _graph("gpt-tiny")
    ref = e.build("cpu", seed=0)
    good = WrapPlan(spec=_specs(graph, MESH2)["per-block"], model=model_fingerprint(ref))
    newer = good.to_json() | {"format": "wrapopt.plan/2"}
    path = os.path.join(tmp, f"newer-{rank}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(newer, f)
    out["err/newer"] = _catch(lambda: WrapPlan.load(path), PlanError)
    four = WrapPlan(spec=baselines(graph, MeshSpec(world_size=4, ranks_per_node=4, shard_size=4))["per-block"],
                    model=model_fingerprint(ref))
    out["err/world"] = _catch(lambda: four.apply(e.build("cpu")), PlanError)
    missing = WrapPlan(spec=PlanSpec((UnitSpec(("layers.9",)), UnitSpec((ROOT,), False)), MESH2),
                       model=model_fingerprint(ref))
    out["err/missing-strict"] = _catch(lambda: missing.apply(e.build("cpu")), PlanMismatchError)
    out["err/missing-names-only"] = _catch(lambda: missing.apply(e.build("cpu"), strict=False), PlanError)
    llama = zoo.get_entry("llama-tiny").build("cpu")
    out["err/other-model"] = _catch(lambda: good.apply(llama), PlanMismatchError)
    sharded = good.apply(e.build("cpu"))
    out["err/twice"] = _catch(lambda: good.apply(sharded), PlanError)
    wrapped = FSDP(e.build("cpu"), device_id=torch.device("cpu"))
    out["err/fsdp1-wrapped"] = _catch(lambda: good.apply(wrapped, strict=False), PlanError)
    no_shard = WrapPlan(spec=baselines(graph, MESH2)["no-shard"], model=model_fingerprint(ref))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    out["err/mesh-shape"] = _catch(lambda: no_shard.apply(e.build("cpu"), mesh=flat), PlanError)
    dist.barrier()  # every rank got here: no bad input left a rank waiting in a collective
    out["err/barrier"] = True


def _mixed_precision_case(rank: int, world: int, out: dict) -> None:
    e = zoo.get_entry("gpt-tiny")
    graph = _graph("gpt-tiny")
    spec = make_plan(graph, MESH2, list(graph.blocks), forward_prefetch=1)
    ref = e.build("cpu", seed=0)
    plan = WrapPlan(spec=spec, model=model_fingerprint(ref),
                    mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    model = plan.apply(copy.deepcopy(ref))
    seen: list[torch.dtype] = []
    model.layers[0].attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
    full, mine = _batches("gpt-tiny", world, rank)
    losses = _mean_over_ranks(_train(model, mine, e.loss), world)
    ref_losses = [float(v) for v in _train(copy.deepcopy(ref), full, e.loss)]
    state = model.layers[0]._get_fsdp_state()
    out["mp"] = {"compute_dtype": str(seen[0]), "stored_dtype": str(model.layers[0].attn.q_proj.weight.dtype),
                 "losses": losses, "ref": ref_losses,
                 "prefetch": [len(getattr(model.layers[i]._get_fsdp_state(), "_states_to_forward_prefetch", []))
                              for i in range(4)] if hasattr(state, "_states_to_forward_prefetch") else None}


def _bench_case(rank: int, world: int, out: dict) -> None:
    from wrapopt.evaluation.bench import measure_plans

    e = zoo.get_entry("gpt-tiny")
    specs = _specs(_graph("gpt-tiny"), MESH2)
    plans = [specs["per-block"], specs["groups-of-2"], specs["per-block"]]
    got = measure_plans(lambda: e.build("cpu", seed=0), plans, e.inputs(), e.loss, repeats=3, warmup=1,
                        measure_memory=False)
    out["bench"] = [m.to_json() for m in got]


def _fsdp_worker(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    _bench_case(rank, world, out)
    _mixed_precision_case(rank, world, out)
    _meta_cases(rank, world, out)
    _inspect_cases(rank, world, out)
    _fsdp1_cases(rank, world, out)
    _error_cases(rank, world, tmp, out)
    return out


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fsdp"))
    return spawn(_fsdp_worker, world_size=2, args=(tmp,), timeout_s=300)


# --- measured steps ---------------------------------------------------------------------------------


def test_measure_plans_times_every_plan_and_splits_its_steps_into_phases(fsdp_results):
    got = fsdp_results[0]["bench"]
    assert [len(m["times_s"]) for m in got] == [3, 3, 3]
    assert fsdp_results[1]["bench"][0]["times_s"] == got[0]["times_s"]  # the slowest rank's, on every rank
    for m in got:
        phases = m["phase_s"]
        assert list(phases) == ["fwd", "bwd", "optim"] and all(v > 0 for v in phases.values())
        # Per rank the phases add up to the step; each phase is the slowest rank's, so their sum
        # may exceed the step's, never by more than the ranks' skew.
        assert 0.5 * m["step_s"] < sum(phases.values()) < 2 * m["step_s"]
    # Same model, seed and batch: the plans train alike, however the rounds were ordered.
    for m in got[1:]:
        assert m["losses"] == pytest.approx(got[0]["losses"], rel=1e-5)


# --- meta-device initialisation -----------------------------------------------------------------------


def test_meta_init_equals_unsharded_init_and_trains_alike(fsdp_results):
    cases = {k: v for k, v in fsdp_results[0].items() if k.startswith("meta/") and isinstance(v, dict)}
    assert len(cases) == 5
    for case, r in cases.items():
        assert r["same_init"], f"{case}: sharded init differs from the unsharded init"
        assert r["tied"], f"{case}: tied parameters came apart"
        assert r["losses"] == pytest.approx(r["ref"], abs=TOL), case
        assert r["ref"][0] != r["ref"][-1]  # it trained


def test_mixed_precision_and_explicit_prefetch_are_applied(fsdp_results):
    mp = fsdp_results[0]["mp"]
    assert mp["compute_dtype"] == "torch.bfloat16" and mp["stored_dtype"] == "torch.float32"
    assert mp["losses"] == pytest.approx(mp["ref"], rel=2e-2)  # bf16 compute: close, not equal
    if mp["prefetch"] is not None:  # FSDP2's private list of units to prefetch
        assert mp["prefetch"] == [1, 1, 1, 0]


def test_meta_init_default_needs_reset_parameters(fsdp_results):
    msg = fsdp_results[0]["meta/default-init-error"]
    assert msg and "reset_parameters" in msg and "norm" in msg and "init_fn" in msg


# --- inspect ---------------------------------------------------------------------------------------


def test_full_tensor_gathers_sharded_and_tied_parameters(fsdp_results):
    for r in fsdp_results:
        assert r["inspect/q_proj"] and r["inspect/tied"]
        assert "q_prj" in r["inspect/typo"] and "layers.0.attn.q_proj.weight" in r["inspect/typo"]  # did you mean


def test_memory_report_is_one_table_on_every_rank(fsdp_results):
    a, b = (r["inspect/report"] for r in fsdp_results)
    assert a["json"] == b["json"]  # the same table on every rank
    rows, per_rank = a["json"]["rows"], a["json"]["per_rank"]
    assert a["json"]["world_size"] == 2 and a["json"]["device"] == "cpu"
    for cat in ("parameters (local shards)", "gradients (local shards)", "optimizer state (local)", "process RSS"):
        assert len(per_rank[cat]) == 2
        r = rows[cat]
        assert r["min"] <= r["median"] <= r["max"] and r["total"] == pytest.approx(sum(per_rank[cat]))
    # The local shards add up to the whole model (tied weights once); AdamW keeps two states per element.
    assert rows["parameters (local shards)"]["total"] == a["unique_bytes"]
    assert rows["optimizer state (local)"]["total"] >= 2 * a["unique_bytes"]
    assert rows["process RSS"]["min"] > 0
    assert "optimizer state (local)" not in a["bare_categories"]
    header = a["table"].splitlines()[0]
    assert all(w in header for w in ("min", "median", "max", "total"))


# --- FSDP1 -------------------------------------------------------------------------------------------


def test_fsdp1_wraps_exactly_the_plan_units_and_trains_alike(fsdp_results):
    r = fsdp_results[0]
    blocks = {f"layers.{i}" for i in range(4)}
    for label in ("per-block", "keep+ckpt", "groups-of-2", "tied-group"):
        case = r[f"fsdp1/{label}"]
        assert set(case["wrapped"]) == blocks | {""}, label
        assert case["losses"] == pytest.approx(case["ref"], abs=TOL), label
        assert case["full_shape"] == [64, 64]
    assert r["fsdp1/per-block"]["warnings"] == []


def test_fsdp1_per_unit_arguments(fsdp_results):
    r = fsdp_results[0]
    assert set(r["fsdp1/per-block"]["wrapped"].values()) == {"FULL_SHARD"}
    kc = r["fsdp1/keep+ckpt"]
    assert all(kc["wrapped"][f"layers.{i}"] == "SHARD_GRAD_OP" for i in range(4))  # reshard_after_forward=False
    assert kc["checkpointed"] == [f"layers.{i}" for i in range(4)]
    assert any("apply_activation_checkpointing" in w for w in kc["warnings"])


def test_fsdp1_says_what_it_cannot_express(fsdp_results):
    r = fsdp_results[0]
    g2 = r["fsdp1/groups-of-2"]
    assert "layers.0 + layers.1" in g2["unsplit"] and "split_groups=True" in g2["unsplit"]
    assert any("one FSDP1 unit per module" in w for w in g2["warnings"])
    tied = r["fsdp1/tied-group"]
    assert any("wte + lm_head" in w and "shares parameters" in w for w in tied["warnings"])  # left to the root


def test_fsdp1_policy_checks_the_world_size_on_every_rank(fsdp_results):
    for r in fsdp_results:
        assert "4 ranks" in r["fsdp1/world"] and "has 2" in r["fsdp1/world"]


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


# --- bad input ---------------------------------------------------------------------------------------


def test_bad_input_fails_on_every_rank_before_any_collective(fsdp_results):
    for r in fsdp_results:
        assert r["err/barrier"]
        assert "newer" in r["err/newer"] and "wrapopt.plan/2" in r["err/newer"] and "format" in r["err/newer"]
        assert "4 ranks" in r["err/world"] and "has 2" in r["err/world"]
        assert "layers.9" in r["err/missing-strict"] and "strict=False" in r["err/missing-strict"]
        assert "layers.9" in r["err/missing-names-only"]
        assert "modules that differ" in r["err/other-model"] and "GPT" in r["err/other-model"]
        assert "already sharded" in r["err/twice"]
        assert "FSDP1" in r["err/fsdp1-wrapped"]
        assert "(2,)" in r["err/mesh-shape"] and "(2, 1)" in r["err/mesh-shape"]


# --- optimize_wrap under a process group ---------------------------------------------------------------


class _Counter:
    def __init__(self, fn=None):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.fn is None:
            raise AssertionError("must not be called")
        return self.fn(*args, **kwargs)


def _optimize_worker(rank: int, world: int, tmp: str, budget: float) -> dict:
    from torch.distributed.fsdp import FSDPModule

    import wrapopt.api as api
    from wrapopt import analytical_compute, optimize_wrap
    from wrapopt.hardware.measure_collectives import measure_fabric

    e = zoo.get_entry("gpt-tiny")
    compute = analytical_compute()  # given, so that no rank spends seconds measuring it
    ref = e.build("cpu", seed=0)
    full, mine = _batches("gpt-tiny", world, rank)
    out: dict = {"ref": [float(v) for v in _train(copy.deepcopy(ref), full, e.loss)]}
    plan_path, fabric_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "fabric.json")

    saved: list[str] = []
    original_save = WrapPlan.save

    def counting_save(self, path):
        saved.append(str(path))
        return original_save(self, path)

    WrapPlan.save = counting_save  # type: ignore[method-assign]
    res = optimize_wrap(copy.deepcopy(ref), e.inputs(), loss_fn=e.loss, fabric="h100-nvlink-ib400", compute=compute,
                        memory_budget=budget, save_plan=plan_path)
    out["sharded"] = isinstance(res.model, FSDPModule)
    out["units"] = [list(u.modules) for u in res.plan.units]
    out["losses"] = _mean_over_ranks(_train(res.model, mine, e.loss), world)
    out["saves"] = len(saved)
    WrapPlan.save = original_save  # type: ignore[method-assign]
    dist.barrier()  # rank 0 has written the plan

    counters = {"plan_model": _Counter(api.plan_model), "search_plan": _Counter(api.search_plan),
                "measure_fabric": _Counter(None)}
    api.plan_model, api.search_plan, api.measure_fabric = (counters["plan_model"], counters["search_plan"],
                                                                counters["measure_fabric"])
    res2 = optimize_wrap(copy.deepcopy(ref), e.inputs(), loss_fn=e.loss, plan=plan_path)
    out["reuse_units"] = [list(u.modules) for u in res2.plan.units]
    out["reuse_sharded"] = isinstance(res2.model, FSDPModule)
    out["reuse_calls"] = {k: c.calls for k, c in counters.items()}
    api.plan_model, api.search_plan = counters["plan_model"].fn, counters["search_plan"].fn

    api.measure_fabric = measure_fabric
    fab = api.measure_fabric(sizes_bytes=(4096, 65536), repeats=2, progress=False, measure_overlap=False)
    if rank == 0:
        fab.save(fabric_path)
    dist.barrier()
    api.measure_fabric = counters["measure_fabric"] = _Counter(None)
    res3 = optimize_wrap(copy.deepcopy(ref), e.inputs(), loss_fn=e.loss, fabric=fabric_path, compute=compute)
    out["fabric"] = {"kind": res3.fabric.kind, "name": res3.fabric.name, "saved": fab.name,
                     "measured_again": counters["measure_fabric"].calls, "sharded": isinstance(res3.model, FSDPModule)}
    return out


def _midway_budget() -> float:
    """A budget between the smallest and largest baseline peak: the plan must shard."""
    from wrapopt.cost import Simulator
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric
    from wrapopt.search.driver import search_plan

    graph = _graph("gpt-tiny")
    sim = Simulator(graph, analytical_fabric(world_size=2), analytical_compute())
    peaks = [s.estimate.peak_bytes for s in search_plan(graph, sim, MESH2).baselines.values()]
    return (min(peaks) + max(peaks)) / 2


@pytest.fixture(scope="module")
def optimize_results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("optimize"))
    return spawn(_optimize_worker, world_size=2, args=(tmp, _midway_budget()), timeout_s=300), tmp


def test_optimize_wrap_trains_like_the_unsharded_model(optimize_results):
    results, _ = optimize_results
    assert results[0]["units"] == results[1]["units"]  # rank 0's plan reached every rank
    assert all(r["sharded"] for r in results)
    assert len(results[0]["units"]) > 1  # the budget forced a sharded plan with units below the root
    r = results[0]
    assert r["losses"] == pytest.approx(r["ref"], abs=TOL)
    assert r["ref"][0] != r["ref"][-1]


def test_optimize_wrap_saves_the_plan_on_rank_0_only(optimize_results):
    results, tmp = optimize_results
    assert [r["saves"] for r in results] == [1, 0]
    saved = WrapPlan.load(os.path.join(tmp, "plan.json"))
    assert [list(u.modules) for u in saved.units] == results[0]["units"]


def test_optimize_wrap_reuses_a_saved_plan(optimize_results):
    results, _ = optimize_results
    for r in results:
        assert r["reuse_units"] == r["units"] and r["reuse_sharded"]
        assert r["reuse_calls"]["plan_model"] == 0  # no search for a plan
        assert r["reuse_calls"]["measure_fabric"] == 0  # and no profiling


def test_optimize_wrap_with_a_plan_runs_no_search_at_all(optimize_results):
    results, _ = optimize_results
    assert all(r["reuse_calls"]["search_plan"] == 0 for r in results)


def test_optimize_wrap_report_shows_the_given_plan(gpt_tiny, tmp_path):
    from wrapopt import optimize_wrap

    model, inputs, graph = gpt_tiny
    path = tmp_path / "every-leaf.json"
    WrapPlan(spec=baselines(graph, MESH2)["every-leaf"], model=model_fingerprint(model)).save(path)
    res = optimize_wrap(model, inputs, loss_fn=zoo.ZOO["gpt-tiny"].loss, world_size=2, plan=path)
    assert res.plan.spec.label == "every-leaf"
    assert res.search.best.plan.units == res.plan.units


def test_optimize_wrap_reuses_a_saved_fabric_profile(optimize_results):
    results, _ = optimize_results
    for r in results:
        f = r["fabric"]
        assert f["kind"] == "measured" and f["name"] == f["saved"]
        assert f["measured_again"] == 0 and f["sharded"]


# --- the plan schema -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written_plans():
    """Plans as the code writes them: every baseline of every zoo model, a search result,
    a rich hand-made plan (group, hpZ, checkpointing, HSDP, prefetch, mixed precision)."""
    from wrapopt.api import plan_model
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric

    out = {}
    for name in ("gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny"):
        model = zoo.get_entry(name).build("meta")
        graph = _graph(name)
        for label, spec in baselines(graph, MESH2).items():
            out[f"{name}/{label}"] = WrapPlan(spec=spec, model=model_fingerprint(model))
        plan, _ = plan_model(graph, model, mesh=MESH2, fabric=analytical_fabric(world_size=2),
                             compute=analytical_compute(), memory_budget=None)
        out[f"{name}/searched"] = plan
    gpt = zoo.get_entry("gpt-tiny").build("meta")
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=8)
    units = (UnitSpec(("layers.0", "layers.1"), 2, True), UnitSpec(("layers.2",), False), UnitSpec(("layers.3",), True, True),
             UnitSpec((ROOT,), False))
    out["rich"] = WrapPlan(spec=PlanSpec(units, mesh, forward_prefetch=1, label="rich"), model=model_fingerprint(gpt),
                           mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    return out


def test_schema_is_draft_2020_12_and_describes_the_format(repo_root):
    schema = plan_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["format"]["const"] == PLAN_FORMAT
    assert set(schema["required"]) == {"format", "model", "mesh", "units"}
    path = os.path.join(repo_root, "wrapopt", "data", "plan.schema.json")
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == schema


def test_every_plan_the_code_writes_validates(written_plans, tmp_path):
    plans = written_plans
    assert len(plans) >= 20
    for key, plan in plans.items():
        path = tmp_path / "p.json"
        plan.save(path)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        assert schema_errors(data) == [], key
        assert WrapPlan.load(path).to_json() == data, key
        try:  # the reference validator too, where it is installed (not a dependency)
            import jsonschema
        except ImportError:
            continue
        jsonschema.Draft202012Validator(plan_schema()).validate(data)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d["units"][0].update(reshard_after_foward=False), "units[0].reshard_after_foward"),
        (lambda d: d.update(unit=[]), "unit"),
        (lambda d: d["model"]["params"]["wte.weight"].update(shape=[2048, "64"]), "model.params['wte.weight'].shape[1]"),
        (lambda d: d["mesh"].update(axis_names=["data"]), "mesh.axis_names[0]"),
        (lambda d: d["prediction"].update(step_s="fast"), "prediction.step_s"),
        (lambda d: d["baselines"]["per-block"].update(fits="yes"), "baselines['per-block'].fits"),
        (lambda d: d.update(label=3), "label"),
    ],
)
def test_schema_errors_name_the_file_and_the_field(written_plans, tmp_path, change, field):
    data = copy.deepcopy(written_plans["gpt-tiny/searched"].to_json())  # to_json shares the plan's own dicts
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as exc:
        WrapPlan.load(path)
    assert str(path) in str(exc.value) and repr(field) in str(exc.value)


# --- fingerprint and the model check ------------------------------------------------------------------


def test_fingerprint_records_module_classes(gpt_tiny):
    model, _, _ = gpt_tiny
    classes = model_fingerprint(model)["module_classes"]
    assert classes["wrapopt.models.zoo.GPTBlock"] == [f"layers.{i}" for i in range(4)]
    assert classes["wrapopt.models.zoo.GPT"] == [""]


def test_check_model_names_modules_whose_class_differs(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = WrapPlan(spec=baselines(graph, MESH2)["per-block"], model=model_fingerprint(model))
    llama = zoo.get_entry("llama-tiny").build("meta")
    with pytest.raises(PlanMismatchError) as exc:
        plan.check_model(llama)
    msg = str(exc.value)
    assert "modules whose class differs: <root> (GPT in the plan, Llama here), layers.0 (GPTBlock in the plan, " \
           "LlamaBlock here)" in msg
    assert msg.index("modules that differ") < msg.index("parameters only in the plan")


def test_check_model_accepts_the_same_weights_under_another_class(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = WrapPlan(spec=baselines(graph, MESH2)["per-block"], model=model_fingerprint(model))
    renamed = zoo.get_entry("gpt-tiny").build("meta")
    renamed.layers[1].__class__ = type("OtherBlock", (zoo.GPTBlock,), {})  # e.g. eager vs SDPA attention
    plan.check_model(renamed)


# --- exports ------------------------------------------------------------------------------------------------


def _plan(graph, model, modules, **kw) -> WrapPlan:
    mp = kw.pop("mixed_precision", None)
    spec = make_plan(graph, kw.pop("mesh", MESH2), modules, **kw)
    return WrapPlan(spec=spec, model=model_fingerprint(model), **({"mixed_precision": mp} if mp else {}))


def test_export_per_block_to_accelerate_is_exact(gpt_tiny):
    model, _, graph = gpt_tiny
    out = export_plan(_plan(graph, model, list(graph.blocks)), to="accelerate")
    assert out.exact and "LOSSES" not in out.text
    fsdp = out.settings["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "GPTBlock"
    assert fsdp["fsdp_reshard_after_forward"] is True and fsdp["fsdp_activation_checkpointing"] is False
    assert out.settings["num_processes"] == 2 and out.settings["distributed_type"] == "FSDP"
    assert "  fsdp_transformer_layer_cls_to_wrap: GPTBlock\n" in out.text
    assert "mixed_precision: 'no'\n" in out.text  # quoted: a bare no is a YAML boolean


def test_export_checkpointed_keep_units_is_exact(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = _plan(graph, model, list(graph.blocks), reshard_after_forward=False, checkpoint=True)
    acc = export_plan(plan, to="accelerate")
    assert acc.exact
    assert acc.settings["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert acc.settings["fsdp_config"]["fsdp_activation_checkpointing"] is True
    lit = export_plan(plan, to="lightning")
    assert lit.exact
    assert lit.settings["sharding_strategy"] == "SHARD_GRAD_OP"
    assert lit.settings["auto_wrap_policy"] == lit.settings["activation_checkpointing_policy"] == ["wrapopt.models.zoo.GPTBlock"]
    assert "from wrapopt.zoo import GPTBlock" in lit.text and "auto_wrap_policy={GPTBlock}" in lit.text
    compile(lit.text, "lightning_export.py", "exec")  # valid Python


def test_export_lists_what_it_loses(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = _plan(graph, model, [("layers.0", "layers.1"), ("layers.2", "layers.3"), ("wte", "lm_head")],
                 forward_prefetch=2, mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    acc = export_plan(plan, to="accelerate")
    assert not acc.exact
    text = "\n".join(acc.losses)
    assert "layers.0 + layers.1 becomes 2 units of one GPTBlock each" in text
    assert "wte + lm_head (Embedding, Linear) is not wrapped" in text
    assert "reduce_dtype float32" in text and "prefetch" in text
    assert acc.settings["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "GPTBlock"
    assert acc.settings["mixed_precision"] == "bf16"
    assert "# LOSSES" in acc.text and all(f"#   - {x}" in acc.text for x in acc.losses)
    lit = export_plan(plan, to="lightning")
    assert any("becomes 2 units" in x for x in lit.losses)
    assert "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in lit.text
    assert "to_fsdp1_policy()" in lit.text  # the exact alternatives are named
    compile(lit.text, "lightning_export.py", "exec")


def test_export_drops_classes_with_instances_outside_the_plan(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = _plan(graph, model, [*graph.blocks, "wpe", "layers.0.attn.q_proj"])
    pol = class_policy(plan, module_classes(model), match_by_name=True)
    assert [c.rsplit(".", 1)[-1] for c in pol.classes] == ["GPTBlock"]
    assert any("Embedding units not wrapped (wpe)" in x and "wte" in x for x in pol.losses)
    assert any("Linear units not wrapped" in x for x in pol.losses)


def test_export_mixed_settings_take_the_majority_and_say_so(gpt_tiny):
    model, _, graph = gpt_tiny
    units = tuple(UnitSpec((b,), i != 0, i == 3) for i, b in enumerate(graph.blocks)) + (UnitSpec((ROOT,), False),)
    plan = WrapPlan(spec=PlanSpec(units, MESH2), model=model_fingerprint(model))
    pol = class_policy(plan, module_classes(model), match_by_name=False)
    assert pol.reshard_after_forward is True and pol.checkpoint is False
    assert any("layers.0" in x and "reshard_after_forward=False" in x for x in pol.losses)
    assert any("checkpointing is off" in x and "layers.3" in x for x in pol.losses)


def test_export_root_only_and_no_shard(gpt_tiny):
    model, _, graph = gpt_tiny
    b = baselines(graph, MESH2)
    root = export_plan(WrapPlan(spec=b["root-only"], model=model_fingerprint(model)), to="accelerate")
    assert root.exact and root.settings["fsdp_config"]["fsdp_auto_wrap_policy"] == "NO_WRAP"
    ddp = export_plan(WrapPlan(spec=b["no-shard"], model=model_fingerprint(model)), to="accelerate")
    assert ddp.settings["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in ddp.settings
    assert export_plan(WrapPlan(spec=b["no-shard"], model=model_fingerprint(model)), to="lightning").settings[
        "sharding_strategy"] == "NO_SHARD"


def test_export_of_an_old_plan_needs_the_model(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = _plan(graph, model, list(graph.blocks))
    plan.model.pop("module_classes")
    with pytest.raises(PlanError, match="--model"):
        export_plan(plan, to="accelerate")
    assert export_plan(plan, to="accelerate", model=model).exact
    with pytest.raises(ValueError, match="accelerate, lightning"):
        export_plan(plan, to="deepspeed", model=model)


def _cli(argv):
    parser = argparse.ArgumentParser(prog="wrapopt")
    add_export_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_export_command(gpt_tiny, tmp_path, capsys):
    model, _, graph = gpt_tiny
    exact, lossy = tmp_path / "exact.json", tmp_path / "lossy.json"
    _plan(graph, model, list(graph.blocks)).save(exact)
    _plan(graph, model, [("layers.0", "layers.1"), ("layers.2", "layers.3")]).save(lossy)
    assert _cli(["export", str(exact), "--to", "accelerate", "--out", str(tmp_path / "acc.yaml")]) == 0
    assert "fsdp_transformer_layer_cls_to_wrap: GPTBlock" in (tmp_path / "acc.yaml").read_text()
    capsys.readouterr()
    assert _cli(["export", str(lossy), "--to", "lightning"]) == 0
    cap = capsys.readouterr()
    assert "auto_wrap_policy={GPTBlock}" in cap.out and "does not reproduce the plan exactly" in cap.err
    assert _cli(["export", str(lossy), "--to", "accelerate", "--strict", "--out", str(tmp_path / "no.yaml")]) == 1
    assert not (tmp_path / "no.yaml").exists()
    assert _cli(["export", str(lossy), "--to", "accelerate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["exact"] is False and data["settings"]["fsdp_config"]["fsdp_version"] == 2
    assert run_export is not None
