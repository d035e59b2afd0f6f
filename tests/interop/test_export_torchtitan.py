"""``wrapopt export --to torchtitan`` (interop/torchtitan.py): the TOML job config of a 1-D, 2-D and
3-D plan, what it cannot say (listed; --strict refuses), TorchTitan's own ConfigManager reading it,
and the other exporters refusing 2-D and 3-D plans in one line naming --to torchtitan."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
import tomllib
import types

import pytest

from tests.ranks import MESH2, tp_plan_specs
from wrapopt.assumptions import Assumptions
from wrapopt.cli import export as export_cli
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop.export import export_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import ROOT, SELECTIVE_OP, MeshSpec, PipelineSpec, PlanSpec, UnitSpec
from wrapopt.train import TrainConfig

SEQ = 64


def _assumptions(seq: int = SEQ) -> Assumptions:
    return Assumptions(loss="cross_entropy", loss_kind="cross_entropy", loss_saved_bytes=0, loss_peak_bytes=0,
                       optimizer="adamw", optimizer_states=2, optimizer_state_bytes=8.0, param_dtype="float32",
                       gather_bytes=2.0, reduce_bytes=4.0, batch=2.0, traced_batch=2, seq=seq,
                       memory_budget_bytes=None, memory_budget_source="none", fabric="test",
                       fabric_kind="analytical", compute="test", compute_kind="analytical")


def _plan(model, spec, *, seq: int = SEQ, **train) -> WrapPlan:
    cfg = TrainConfig.preset("bf16", **train)
    return WrapPlan(spec=spec, model=model_fingerprint(model), train=cfg,
                    assumptions=_assumptions(seq) if seq else None)


def _titan_units(blocks, *, checkpoint=lambda i: False, raf=True) -> tuple[UnitSpec, ...]:
    """TorchTitan's own units: the embedding, each block, norm + head, the root."""
    return (UnitSpec(("embed_tokens",), raf), *(UnitSpec((b,), raf, checkpoint(i)) for i, b in enumerate(blocks)),
            UnitSpec(("norm", "lm_head"), False), UnitSpec((ROOT,), False))


def _toml(out) -> dict:
    return tomllib.loads(out.text)


@pytest.fixture(scope="module")
def plans(llama_tiny) -> dict[str, WrapPlan]:
    model, _, graph = llama_tiny
    blocks = graph.blocks  # 6 LlamaBlocks
    one_d = _plan(model, PlanSpec(_titan_units(blocks, checkpoint=lambda i: True), MESH2),
                  micro_batch=2, grad_accumulation=3, accumulation_sync="every")
    tp = dataclasses.replace(tp_plan_specs(graph)["some-ckpt"].tp, sequence_parallel=True, loss_parallel=True)
    two_d = _plan(model, PlanSpec(_titan_units(blocks, checkpoint=lambda i: i % 2 == 1),
                                  MeshSpec(world_size=8, ranks_per_node=4, shard_size=2, tp_size=2), tp=tp),
                  micro_batch=4, global_batch=32)
    stages = (("embed_tokens", blocks[0]), blocks[1:3], blocks[3:5], (blocks[5], "norm", "lm_head"))
    three_d = _plan(model, PlanSpec(_titan_units(blocks, checkpoint=lambda i: SELECTIVE_OP, raf=False),
                                    MeshSpec(world_size=8, ranks_per_node=4, shard_size=2, tp_size=2, pp_size=2),
                                    tp=tp, pipeline=PipelineSpec(stages=stages, schedule="Interleaved1F1B",
                                                                 microbatches=4)),
                    micro_batch=1)
    return {"1d": one_d, "2d": two_d, "3d": three_d}


def test_a_1d_plan_is_exact(plans):
    out = export_plan(plans["1d"], to="torchtitan")
    assert out.exact, out.losses
    t = _toml(out)
    assert t == out.settings  # the file says what the settings say
    assert t["parallelism"] == {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 2,
                                "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1,
                                "fsdp_reshard_after_forward": "default"}
    assert t["activation_checkpoint"] == {"mode": "full"}
    # local batch: per data-parallel rank per accumulation step; global = 2 x 3 accumulation x 2 ranks
    assert t["training"] == {"local_batch_size": 2, "global_batch_size": 12, "seq_len": SEQ,
                             "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"}
    assert t["optimizer"] == {"name": "AdamW"}
    assert "--job.config_file" in out.text and "The plan is reproduced exactly." in out.text
    assert out.fields["sync"] == out.fields["accumulation"] == out.fields["micro_batch"] == "written"


def test_a_2d_plan_carries_tp_and_every_second_block_checkpointed(plans):
    out = export_plan(plans["2d"], to="torchtitan")
    assert out.exact, out.losses
    t = _toml(out)
    assert t["parallelism"]["tensor_parallel_degree"] == 2 and t["parallelism"]["data_parallel_shard_degree"] == 2
    assert t["parallelism"]["data_parallel_replicate_degree"] == 2  # 8 ranks = 2 x 2 x tp 2
    assert t["parallelism"]["disable_loss_parallel"] is False
    assert t["parallelism"]["enable_async_tensor_parallel"] is False
    assert t["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}
    assert t["training"]["local_batch_size"] == 4 and t["training"]["global_batch_size"] == 32


def test_a_3d_plan_writes_the_stages_in_torchtitans_names(plans):
    out = export_plan(plans["3d"], to="torchtitan")
    t = _toml(out)
    par = t["parallelism"]
    assert (par["pipeline_parallel_degree"], par["pipeline_parallel_schedule"]) == (2, "Interleaved1F1B")
    assert par["pipeline_parallel_microbatch_size"] == 1 and par["fsdp_reshard_after_forward"] == "never"
    assert par["module_fqns_per_model_part"] == [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"],
                                                 ["layers.3", "layers.4"], ["layers.5", "norm", "output"]]
    assert t["training"]["local_batch_size"] == 4  # 4 pipeline micro-batches of 1
    assert t["training"]["global_batch_size"] == 8  # x 2 data-parallel ranks
    assert t["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert not out.losses  # selective-op is TorchTitan's op-level policy: nothing lost


def test_what_torchtitan_cannot_say_is_listed(llama_tiny, plans):
    model, _, graph = llama_tiny
    blocks = graph.blocks
    spec = plans["2d"].spec
    tp = dataclasses.replace(spec.tp, sequence_parallel=False, async_tp=True)
    units = (UnitSpec(blocks[:2], True, True), *(UnitSpec((b,), i % 2 == 0, i == 3) for i, b in enumerate(blocks[2:])),
             UnitSpec(("layers.5.mlp",)), UnitSpec((ROOT,), False))
    plan = _plan(model, dataclasses.replace(spec, units=units, tp=tp, forward_prefetch=2), seq=0)
    out = export_plan(plan, to="torchtitan")
    text = "\n".join(out.losses)
    for words in ("sequence parallelism off", "async TP is written off", "grouped units of several blocks "
                  "(layers.0..1)", "units inside blocks (layers.5.mlp)", "one reshard_after_forward for every block",
                  "one checkpointing mode for every block", "tok_embeddings as a unit of its own",
                  "no sequence length", "forward prefetch"):
        assert words in text, words
    assert "seq_len" not in _toml(out)["training"]
    odd = _plan(model, plans["2d"].spec, micro_batch=4, global_batch=36)  # 4 x 4 data-parallel ranks: 16 per step
    assert any("global batch 36 is not a multiple of local_batch_size 4 x 4" in x
               for x in export_plan(odd, to="torchtitan").losses)
    assert all(f"#   - {x}" in out.text for x in out.losses)


def _cli(argv) -> int:
    parser = argparse.ArgumentParser(prog="wrapopt")
    export_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return export_cli.run(parser.parse_args(argv))


def test_strict_refuses_and_lists_each_item(plans, tmp_path, capsys):
    path, toml = tmp_path / "p3.json", tmp_path / "p3.toml"
    spec = plans["3d"].spec  # full and selective-op blocks mixed: TorchTitan has one mode for all
    units = tuple(dataclasses.replace(u, checkpoint=(True, SELECTIVE_OP)[i % 2]) if u.checkpoint else u
                  for i, u in enumerate(spec.units))
    lossy = dataclasses.replace(plans["3d"], spec=dataclasses.replace(spec, units=units))
    lossy.save(path)
    assert _cli(["export", str(path), "--to", "torchtitan", "--strict", "--out", str(toml)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert not toml.exists() and "nothing written (--strict)" in err[-1]
    out = export_plan(lossy, to="torchtitan")
    assert out.losses
    losses = err[err.index(next(ln for ln in err if "does not reproduce" in ln)) + 1:-1]
    assert losses == [f"  - {x}" for x in out.losses]
    assert [f"  - {x}" for x in out.script] == err[1:1 + len(out.script)]  # then what the launch must do
    assert _cli(["export", str(path), "--to", "torchtitan", "--out", str(toml)]) == 0
    assert tomllib.loads(toml.read_text())["parallelism"]["pipeline_parallel_degree"] == 2


@pytest.mark.parametrize("which", ["2d", "3d"])
def test_the_other_exporters_refuse_multi_d_plans_naming_torchtitan(plans, which):
    for to in ("accelerate", "lightning", "lightning-fsdp2", "lightning-fsdp1", "fsdp1"):
        with pytest.raises(PlanError) as exc:
            export_plan(plans[which], to=to)
        msg = str(exc.value)
        assert "\n" not in msg and f"this {which[0]}-D plan" in msg and "`--to torchtitan`" in msg, msg
        assert f"cannot export to {to}" in msg


def test_hostile_label_stays_in_a_comment(plans):
    plan = plans["1d"]
    plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, label='x"\n[parallelism]\nbad = 1'))
    t = _toml(export_plan(plan, to="torchtitan"))
    assert "bad" not in t.get("parallelism", {}) and t["parallelism"]["data_parallel_shard_degree"] == 2


def _titan_config():
    """torchtitan.config (0.2.x), or skip. Importing the package runs torchtitan/__init__.py, which
    imports its quantization and MoE kernels (triton); the config needs none of it, so on a machine
    without them the config package is imported under a bare package stub."""
    if "torchtitan.config" in sys.modules:  # imported already (under the stub, whose __spec__ is None)
        return sys.modules["torchtitan.config"]
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip("torchtitan is not installed (the interop extra: pip install --no-deps 'torchtitan<0.3' tyro "
                    "docstring-parser typeguard)")
    try:
        return importlib.import_module("torchtitan.config")
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        del sys.modules[name]
    stub = types.ModuleType("torchtitan")
    stub.__path__ = list(spec.submodule_search_locations)
    sys.modules["torchtitan"] = stub
    try:
        config = importlib.import_module("torchtitan.config")
    except ImportError as e:
        pytest.skip(f"torchtitan.config does not import here: {e}")
    if not hasattr(importlib.import_module("torchtitan.config.job_config"), "JobConfig"):
        pytest.skip("this torchtitan reads no TOML job config (0.3 and later); the export is for 0.2.x")
    return config


def test_torchtitans_config_manager_reads_the_export(plans, tmp_path):
    config = _titan_config()
    for which, plan in plans.items():
        path = tmp_path / f"{which}.toml"
        path.write_text(export_plan(plan, to="torchtitan").text)
        job = config.ConfigManager().parse_args(["--job.config_file", str(path)])
        mesh, par = plan.mesh, job.parallelism
        assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree, par.tensor_parallel_degree,
                par.pipeline_parallel_degree) == (mesh.replicate_size, mesh.shard_size, mesh.tp_size, mesh.pp_size)
        assert par.data_parallel_replicate_degree * par.data_parallel_shard_degree * par.tensor_parallel_degree \
            * par.pipeline_parallel_degree == mesh.world_size
        assert job.training.seq_len == SEQ and job.training.local_batch_size > 0
        if plan.spec.pipeline is not None:
            assert par.pipeline_parallel_schedule == plan.spec.pipeline.schedule
            assert len(par.module_fqns_per_model_part) == len(plan.spec.pipeline.stages)


def test_storage_dtype_optimizer_and_a_tied_unit(gpt_tiny, plans):
    pure = dataclasses.replace(plans["1d"], assumptions=dataclasses.replace(_assumptions(), param_dtype="bfloat16"))
    assert _toml(export_plan(pure, to="torchtitan"))["training"]["dtype"] == "bfloat16"  # TorchTitan's pure bf16
    model, _, graph = gpt_tiny  # wte and lm_head tied: one unit across both ends of the model
    units = (*(UnitSpec((b,)) for b in graph.blocks), UnitSpec(("wte", "lm_head")), UnitSpec((ROOT,), False))
    out = export_plan(_plan(model, PlanSpec(units, MESH2), micro_batch=1, optimizer="sgd"), to="torchtitan")
    text = "\n".join(out.losses)
    assert "units spanning both ends of the model (wte..lm_head" in text
    assert "scored for sgd" in text and _toml(out)["optimizer"] == {"name": "AdamW"}
