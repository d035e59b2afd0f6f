"""Issue 51, "exports carry the whole plan": every exporter writes each plan field, states it for the
training script, or lists it as lost (file and stderr), and --strict refuses any loss; the Lightning
and FSDP1 modules find the plan relative to themselves; generated code imports only model classes."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import tomllib

import pytest

from tests.reliability.common import run_cli
from wrapopt.assumptions import Assumptions
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop.export import export_plan
from wrapopt.interop.fields import LOST, STATED, WRITTEN, plan_fields
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import ROOT, MeshSpec, PipelineSpec, PlanSpec, UnitSpec
from wrapopt.tp import builtin_tp_plan
from wrapopt.train import TrainConfig

FSDP_ONLY = ("accelerate", "lightning-fsdp2", "lightning-fsdp1", "fsdp1")
TARGETS = (*FSDP_ONLY, "torchtitan")
SEQ = 32
W, S, L = WRITTEN, STATED, LOST


def _assumptions() -> Assumptions:
    return Assumptions(loss="cross_entropy", loss_kind="cross_entropy", loss_saved_bytes=0, loss_peak_bytes=0,
                       optimizer="adamw", optimizer_states=2, optimizer_state_bytes=8.0, param_dtype="float32",
                       gather_bytes=2.0, reduce_bytes=4.0, batch=2.0, traced_batch=2, seq=SEQ,
                       memory_budget_bytes=None, memory_budget_source="none", fabric="test",
                       fabric_kind="analytical", compute="test", compute_kind="analytical")


def _plan_1d(gpt_tiny, sync: str) -> WrapPlan:
    """A 1-D plan setting every field an FSDP-only plan has: 2 machines of 4 ranks, HSDP (2 x 4), blocks
    kept after forward or checkpointed in turn, prefetch, CPU offload, bf16, micro-batch 2 x 4 accumulated."""
    model, _, graph = gpt_tiny
    units = tuple(UnitSpec((b,), i % 2 == 0, i % 2 == 1) for i, b in enumerate(graph.blocks))
    mesh = MeshSpec(world_size=8, ranks_per_node=4, shard_size=4)
    spec = PlanSpec((*units, UnitSpec((ROOT,), False)), mesh, forward_prefetch=1, offload=True, label="every-field")
    train = TrainConfig.preset("bf16", grad_accumulation=4, micro_batch=2, global_batch=2 * 4 * 8,
                               accumulation_sync=sync)
    return WrapPlan(spec=spec, model=model_fingerprint(model), train=train, assumptions=_assumptions())


# Each field's status per target (accelerate, lightning-fsdp2, lightning-fsdp1, fsdp1, torchtitan), by sync mode.
_EXPECTED = {
    "units": (W, W, W, W, W), "mesh": (W, W, W, W, W), "multi_node": (S, W, W, S, S), "hsdp": (L, W, W, W, W),
    "reshard": (W, W, W, W, W), "checkpoint": (W, W, W, W, W), "prefetch": (L, W, W, W, L),
    "offload": (W, W, W, W, W), "mixed_precision": (W, W, W, W, W), "micro_batch": (S, S, S, S, W),
    "accumulation": (S, W, W, S, W), "seq_len": (S, S, S, S, W), "optimizer": (S, S, S, S, W),
}
_SYNC = {"last": (S, W, L, S, L), "every": (L, W, W, S, W)}


@pytest.mark.parametrize("sync", ["last", "every"])
@pytest.mark.parametrize("to", TARGETS)
def test_every_exporter_accounts_for_every_field(gpt_tiny, to, sync):
    plan = _plan_1d(gpt_tiny, sync)
    out = export_plan(plan, to=to)
    assert set(out.fields) == set(plan_fields(plan)) == {*_EXPECTED, "sync"}  # every field the plan sets
    i = TARGETS.index(to)
    assert out.fields == {**{f: st[i] for f, st in _EXPECTED.items()}, "sync": _SYNC[sync][i]}
    assert out.exact == (not out.losses) and (LOST not in out.fields.values() or out.losses)
    assert all(f"#   - {x}" in out.text for x in out.losses + out.script)  # said in the file
    assert ("The plan is reproduced exactly" in out.text) == out.exact
    if out.fields["sync"] == LOST:
        assert any(x.startswith("SYNC MODE") for x in out.losses)
    # what the file writes of the offload and batch split, in the tool's own words
    written = {
        "accelerate": ["fsdp_offload_params: true", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4 accelerate launch",
                       "num_machines: 2", "FILL IN"],
        "lightning-fsdp2": ["'accumulate_grad_batches': 4", "'num_nodes': 2",
                            "return SyncLastStrategy(" if sync == "last" else "return ModelParallelStrategy("],
        "lightning-fsdp1": ["cpu_offload=True", "'accumulate_grad_batches': 4", "device_mesh=(2, 4)"],
        "fsdp1": ["CPUOffload(offload_params=True)", "ACCUMULATION = 4", f"SYNC = {sync!r}"],
        "torchtitan": ["enable_cpu_offload = true", "local_batch_size = 2", "global_batch_size = 64"],
    }[to]
    assert all(w in out.text for w in written), [w for w in written if w not in out.text]
    assert "DataLoader(batch_size=2)" in "\n".join(out.script) or to == "torchtitan"
    if to != "accelerate":
        compile(out.text, f"{to}.py", "exec") if to != "torchtitan" else tomllib.loads(out.text)


def test_selective_checkpointing_is_written_lost_or_refused(gpt_tiny):
    plan = _plan_1d(gpt_tiny, "every")
    units = tuple(u if u.is_root else dataclasses.replace(u, checkpoint="selective-op") for u in plan.units)
    plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, units=units))
    status = {to: export_plan(plan, to=to).fields["selective_checkpoint"] for to in TARGETS if to != "fsdp1"}
    assert status == {"accelerate": L, "lightning-fsdp2": W, "lightning-fsdp1": L, "torchtitan": W}
    acc = export_plan(plan, to="accelerate")
    assert acc.settings["fsdp_config"]["fsdp_activation_checkpointing"] is True  # full holds less: still fits
    with pytest.raises(PlanError, match="selective-op"):  # its module calls plan.fsdp1_checkpoint_fn at run time
        export_plan(plan, to="fsdp1")


def test_a_3d_plan_every_field_in_torchtitan_and_refused_elsewhere(llama_tiny):
    model, _, graph = llama_tiny
    blocks = graph.blocks
    tp = dataclasses.replace(builtin_tp_plan(graph), sequence_parallel=True, loss_parallel=True, async_tp=True)
    stages = (("embed_tokens", blocks[0]), tuple(blocks[1:3]), tuple(blocks[3:5]), (blocks[5], "norm", "lm_head"))
    units = (UnitSpec(("embed_tokens",)), *(UnitSpec((b,), False, True) for b in blocks), UnitSpec(("norm", "lm_head")),
             UnitSpec((ROOT,), False))
    spec = PlanSpec(units, MeshSpec(world_size=16, ranks_per_node=4, shard_size=2, tp_size=2, pp_size=2), tp=tp,
                    pipeline=PipelineSpec(stages=stages, schedule="Interleaved1F1B", microbatches=4), offload=True)
    plan = WrapPlan(spec=spec, model=model_fingerprint(model), assumptions=_assumptions(),
                    train=TrainConfig.preset("bf16", micro_batch=1, global_batch=32, accumulation_sync="last",
                                             grad_accumulation=2))
    out = export_plan(plan, to="torchtitan")
    fields = plan_fields(plan)
    assert {"tp", "sequence_parallel", "loss_parallel", "async_tp", "pipeline", "offload", "sync"} <= set(fields)
    assert set(out.fields) == set(fields)
    assert out.fields["sync"] == LOST and out.fields["pipeline"] == out.fields["tp"] == WRITTEN
    assert any("async TP" in x for x in out.losses) and not out.exact
    for to in FSDP_ONLY:
        with pytest.raises(PlanError, match="--to torchtitan"):
            export_plan(plan, to=to)


def test_strict_refuses_a_lost_sync_mode_and_offload_is_written(gpt_tiny, tmp_path, capsys):
    """The sweep's worst case: a plan that fits only with offload. Its YAML offloads, and the sync mode
    Accelerate cannot say is on stderr; --strict writes nothing."""
    path, yaml = tmp_path / "plan.json", tmp_path / "acc.yaml"
    _plan_1d(gpt_tiny, "every").save(path)
    code, err = run_cli(["export", str(path), "--to", "accelerate", "--strict", "--out", str(yaml)], capsys)
    assert code == 1 and not yaml.exists() and "nothing written (--strict)" in err
    assert "SYNC MODE" in err and "sync_each_batch=True" in err and "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4" in err
    _plan_1d(gpt_tiny, "last").save(path)
    code, err = run_cli(["export", str(path), "--to", "accelerate", "--out", str(yaml)], capsys)
    assert code == 0 and "fsdp_offload_params: true" in yaml.read_text()
    assert "machine_rank: 0" not in yaml.read_text()  # 2 machines: filled in per machine, not hard-coded
    if importlib.util.find_spec("accelerate") is not None:  # the real loader takes the file as written
        from accelerate.commands.config.config_args import load_config_from_file

        config = load_config_from_file(str(yaml))
        assert config.num_machines == 2 and config.fsdp_config["fsdp_offload_params"] is True


@pytest.mark.parametrize("to", ["lightning", "fsdp1"])
def test_generated_modules_find_the_plan_beside_them(gpt_tiny, tmp_path, monkeypatch, capsys, to):
    model, _, graph = gpt_tiny
    units = tuple(UnitSpec((b,)) for b in graph.blocks)
    path = tmp_path / "plans" / "plan.json"
    path.parent.mkdir()
    WrapPlan(spec=PlanSpec((*units, UnitSpec((ROOT,), False)), MeshSpec(2, 2, 2)),
             model=model_fingerprint(model)).save(path)
    code_path = tmp_path / "code" / "planned.py"
    code_path.parent.mkdir()
    assert run_cli(["export", str(path), "--to", to, "--out", str(code_path)], capsys)[0] == 0
    text = code_path.read_text()
    assert str(tmp_path) not in text  # no absolute path baked in, not even in comments
    namespace = {"__file__": str(code_path)}
    body = text.split("\nPLAN_PATH", 1)[1].split("\n\n\n", 2)[:2]  # the path and plan_path(), run alone
    exec(compile("import os\nPLAN_PATH" + "\n\n\n".join(body), "planned.py", "exec"), namespace)
    assert namespace["PLAN_PATH"] == os.path.join("..", "plans", "plan.json")
    assert os.path.samefile(namespace["plan_path"](), path)
    monkeypatch.setenv("WRAPOPT_PLAN", "/elsewhere/plan.json")
    assert namespace["plan_path"]() == "/elsewhere/plan.json"  # or given at run time


@pytest.mark.parametrize("key", ["GPTBlock", "os.system", "subprocess.Popen", "this.GPTBlock", "builtins.GPTBlock"])
def test_class_keys_outside_a_model_package_are_refused(gpt_tiny, tmp_path, capsys, key):
    """`from  import GPTBlock` (a SyntaxError) and imports of os, subprocess or this were written."""
    model, _, graph = gpt_tiny
    units = tuple(UnitSpec((b,)) for b in graph.blocks)
    data = WrapPlan(spec=PlanSpec((*units, UnitSpec((ROOT,), False)), MeshSpec(2, 2, 2)),
                    model=model_fingerprint(model)).to_json()
    classes = data["model"]["module_classes"]
    classes[key] = classes.pop(next(k for k in classes if k.endswith(".GPTBlock")))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    code, err = run_cli(["export", str(path), "--to", "lightning-fsdp1"], capsys)
    assert code == 1 and err.count("\n") == 1 and "module_classes" in err and repr(key) in err
    assert ("standard-library" in err) == ("." in key)
    for to in TARGETS:
        with pytest.raises(PlanError, match="module_classes"):
            export_plan(WrapPlan.load(path), to=to)


def test_the_fsdp1_policy_offloads_as_planned(gpt_tiny):
    """WrapPlan.to_fsdp1_policy() (what the fsdp1 module and FSDP1 users wrap with) dropped the offload."""
    plan = _plan_1d(gpt_tiny, "last")
    assert plan.to_fsdp1_policy().root_kwargs["cpu_offload"].offload_params is True
    plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, offload=False))
    assert "cpu_offload" not in plan.to_fsdp1_policy().root_kwargs


def test_a_lost_sync_mode_heads_the_losses(gpt_tiny):
    """It decides whether the step fits (accelerate) or how fast it runs (Lightning FSDP1, TorchTitan)."""
    for to, sync in (("accelerate", "every"), ("lightning-fsdp1", "last"), ("torchtitan", "last")):
        out = export_plan(_plan_1d(gpt_tiny, sync), to=to)
        assert out.losses[0].startswith("SYNC MODE") and len(out.losses) > 1, to
