"""Each export loaded by the real tool: Accelerate builds its FSDP plugin from the YAML and its
FSDP2 wrap policy picks the block class; Lightning imports the module and builds its strategy.
Skipped, with the reason, where the ``interop`` extra (accelerate, lightning) is not installed."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tests.ranks import MESH2
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop.export import export_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import make_plan
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec

_NO_EXTRA = "the interop extra is not installed: pip install 'wrapopt[interop]'"


def _saved(tmp_path, graph, model, units, *, mesh=MESH2, name="plan.json", **kw):
    """A plan file, written and read back: the exports run from the file, without the model."""
    spec = make_plan(graph, mesh, units, **kw) if not isinstance(units, PlanSpec) else units
    path = tmp_path / name
    WrapPlan(spec=spec, model=model_fingerprint(model)).save(path)
    return WrapPlan.load(path), str(path)


# -- Accelerate ---------------------------------------------------------------------------------


def _accelerate_wraps(yaml_path, model, monkeypatch) -> tuple[object, list[str]]:
    """The plugin ``accelerate launch --config_file`` gives the script, and the modules its FSDP2
    policy wraps (and checkpoints, when activation_checkpointing is on) in ``model``."""
    pytest.importorskip("accelerate", reason=_NO_EXTRA)
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    config = load_config_from_file(str(yaml_path))
    assert config.distributed_type == DistributedType.FSDP and config.num_processes == 2
    fsdp = config.fsdp_config
    # The environment `accelerate launch` sets from fsdp_config (accelerate/utils/launch.py,
    # prepare_multi_gpu_env; its launch command itself needs psutil, not installed here).
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": str(fsdp["fsdp_version"]),
           "FSDP_AUTO_WRAP_POLICY": fsdp["fsdp_auto_wrap_policy"],
           "FSDP_RESHARD_AFTER_FORWARD": str(fsdp["fsdp_reshard_after_forward"]).lower(),
           "FSDP_OFFLOAD_PARAMS": str(fsdp["fsdp_offload_params"]).lower(),
           "FSDP_STATE_DICT_TYPE": fsdp["fsdp_state_dict_type"],
           "FSDP_ACTIVATION_CHECKPOINTING": str(fsdp["fsdp_activation_checkpointing"]).lower()}
    if "fsdp_transformer_layer_cls_to_wrap" in fsdp:
        env["FSDP_TRANSFORMER_CLS_TO_WRAP"] = fsdp["fsdp_transformer_layer_cls_to_wrap"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    return plugin, [n for n, m in model.named_modules() if policy is not None and policy(m)]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """``(model, graph)`` of the tiny Hugging Face Llama (LlamaDecoderLayer blocks), on meta."""
    pytest.importorskip("accelerate", reason=_NO_EXTRA)  # its only users are the Accelerate tests
    pytest.importorskip("transformers", reason="hf: models need transformers")
    from tests.models.hf_configs import write_config
    from wrapopt.models.sources import resolve_model
    from wrapopt.trace.meta import trace_model

    src = resolve_model(f"hf:{write_config('llama', str(tmp_path_factory.mktemp('hf')))}", batch=2, seq=16)
    model = src.build("meta")
    return model, trace_model(model, src.inputs)


def test_accelerate_wraps_llama_decoder_layers(hf_llama, tmp_path, monkeypatch):
    model, graph = hf_llama
    plan, path = _saved(tmp_path, graph, model, list(graph.blocks), checkpoint=True)
    out = export_plan(plan, to="accelerate", source=path)
    assert out.exact
    (tmp_path / "acc.yaml").write_text(out.text)
    plugin, wrapped = _accelerate_wraps(tmp_path / "acc.yaml", model, monkeypatch)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.activation_checkpointing is True and plugin.reshard_after_forward is True
    assert wrapped == list(graph.blocks)  # checkpointed too: accelerate checkpoints what this policy picks


def test_accelerate_wraps_the_block_not_what_the_plan_cut_inside_it(hf_llama, tmp_path, monkeypatch):
    """Issue 34: the embedding and each MLP as units wrapped and checkpointed Embedding and LlamaMLP."""
    model, graph = hf_llama
    units = [UnitSpec(("model.embed_tokens",), True)] + [UnitSpec((f"{b}.mlp",), True, True) for b in graph.blocks]
    plan, path = _saved(tmp_path, graph, model, PlanSpec((*units, UnitSpec((ROOT,), True)), MESH2))
    out = export_plan(plan, to="accelerate", source=path)
    (tmp_path / "acc.yaml").write_text(out.text)
    plugin, wrapped = _accelerate_wraps(tmp_path / "acc.yaml", model, monkeypatch)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"] and wrapped == list(graph.blocks)
    assert plugin.activation_checkpointing is False  # no Embedding or LlamaMLP checkpointed
    assert any("model.embed_tokens" in x for x in out.losses) and any("model.layers.0.mlp" in x for x in out.losses)


def test_accelerate_groups_of_blocks_become_blocks(llama_tiny, tmp_path, monkeypatch):
    model, _, graph = llama_tiny
    pairs = [tuple(graph.blocks[i:i + 2]) for i in range(0, len(graph.blocks), 2)]
    plan, path = _saved(tmp_path, graph, model, pairs, reshard_after_forward=False)
    out = export_plan(plan, to="accelerate", source=path)
    (tmp_path / "acc.yaml").write_text(out.text)
    assert "# LOSSES" in out.text and "become one unit per block" in out.text
    plugin, wrapped = _accelerate_wraps(tmp_path / "acc.yaml", model, monkeypatch)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaBlock"] and wrapped == list(graph.blocks)
    assert plugin.reshard_after_forward is False


# -- Lightning ----------------------------------------------------------------------------------


def _import(path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def _lightning_module(tmp_path, plan, path: str, to: str = "lightning"):
    pytest.importorskip("lightning", reason=_NO_EXTRA)
    out = export_plan(plan, to=to, source=path, out=str(tmp_path / "planned.py"))
    (tmp_path / "planned.py").write_text(out.text)
    return out, _import(tmp_path / "planned.py", f"planned_{to.replace('-', '_')}")


def _configure(module, model, monkeypatch, device_mesh) -> list[tuple]:
    """Run configure_model twice with a stand-in mesh; the plan's apply calls it made."""
    calls = []
    monkeypatch.setattr(WrapPlan, "apply", lambda self, m, mesh=None, **kw: calls.append((self, m, mesh)) or m)

    class Planned(module.PlannedModule):
        def __init__(self):
            super().__init__()
            self.model = model

    lm = Planned()
    lm._device_mesh = device_mesh  # what ModelParallelStrategy sets before configure_model
    lm.configure_model()
    lm.configure_model()
    return calls


def test_lightning_fsdp2_strategy_and_configure_model(llama_tiny, tmp_path, monkeypatch):
    model, _, graph = llama_tiny
    plan, path = _saved(tmp_path, graph, model, list(graph.blocks), checkpoint=True)
    out, module = _lightning_module(tmp_path, plan, path)
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert out.exact and out.target == "lightning-fsdp2" and module.PLAN_PATH == "plan.json"  # beside the module
    assert os.path.normpath(module.plan_path()) == path
    strategy = module.make_strategy()
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 1)
    assert (module.NUM_NODES, module.DEVICES_PER_NODE) == (1, 2)
    assert "configure_model" in vars(module.PlannedModule)
    dp = object()
    calls = _configure(module, model, monkeypatch, {"data_parallel": dp})
    assert len(calls) == 1  # applied once, though Lightning may call the hook again
    loaded, target, mesh = calls[0]
    assert loaded.spec == plan.spec and target is model and mesh is dp


def test_lightning_fsdp2_hsdp_plan_builds_its_own_mesh(llama_tiny, tmp_path, monkeypatch):
    model, _, graph = llama_tiny
    mesh = MeshSpec(world_size=4, ranks_per_node=2, shard_size=2)
    plan, path = _saved(tmp_path, graph, model, list(graph.blocks), mesh=mesh)
    out, module = _lightning_module(tmp_path, plan, path, to="lightning-fsdp2")
    assert module.make_strategy()._data_parallel_size == 4 and (module.NUM_NODES, module.DEVICES_PER_NODE) == (2, 2)
    calls = _configure(module, model, monkeypatch, {"data_parallel": object()})
    assert calls[0][2] is None  # apply builds the plan's (replicate, shard) mesh


def test_lightning_fsdp2_plan_path_is_data(llama_tiny, tmp_path, monkeypatch):
    """A hostile plan path reaches the module as a string literal only (issue 33's guarantee)."""
    model, _, graph = llama_tiny
    _, path = _saved(tmp_path, graph, model, list(graph.blocks), name="p'\n__import__('os').system('x') #.json")
    plan = WrapPlan.load(path)
    _, module = _lightning_module(tmp_path, plan, path)
    assert os.path.normpath(module.plan_path()) == path and not os.path.isabs(module.PLAN_PATH)
    assert _configure(module, model, monkeypatch, {"data_parallel": None})[0][0].spec == plan.spec


def test_lightning_fsdp1_strategy_builds(gpt_tiny, tmp_path):
    model, _, graph = gpt_tiny
    plan, path = _saved(tmp_path, graph, model, list(graph.blocks), checkpoint=True)
    out, module = _lightning_module(tmp_path, plan, path, to="lightning-fsdp1")
    from lightning.pytorch.strategies import FSDPStrategy
    from wrapopt.models.zoo import GPTBlock
    strategy = module.strategy
    assert isinstance(strategy, FSDPStrategy) and out.exact
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {GPTBlock}
    assert strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes == {GPTBlock}


def test_accelerate_reads_the_stated_accumulation(gpt_tiny, tmp_path, monkeypatch):
    """The launch line's ACCELERATE_GRADIENT_ACCUMULATION_STEPS reaches Accelerator() (the config has no key)."""
    pytest.importorskip("accelerate", reason=_NO_EXTRA)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from wrapopt.train import TrainConfig

    model, _, graph = gpt_tiny
    plan = WrapPlan(spec=make_plan(graph, MESH2, list(graph.blocks)), model=model_fingerprint(model),
                    train=TrainConfig(grad_accumulation=3, accumulation_sync="last", micro_batch=1, global_batch=6))
    out = export_plan(plan, to="accelerate")
    launch = out.text.splitlines()[0]
    assert out.exact and "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=3 accelerate launch" in launch
    name, value = launch.split(": ", 1)[1].split()[0].split("=")
    monkeypatch.setenv(name, value)
    try:
        accelerator = Accelerator(cpu=True)
        assert accelerator.gradient_accumulation_steps == 3
        assert not accelerator.gradient_state.plugin_kwargs.get("sync_each_batch")  # accumulate(): sync last
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
