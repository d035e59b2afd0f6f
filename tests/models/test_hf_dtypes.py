"""A Hugging Face config's stored dtype (``torch_dtype``: "bfloat16" in every released
config) is how its weights were saved, not how they train: under ``--precision bf16`` the
sharded parameters and the optimizer state are float32 master copies, and the training
line names all four dtypes. See [Note: stored dtype is not the training dtype] in
wrapopt/models/hf.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from wrapopt.api import estimate  # noqa: E402
from wrapopt.cli.main import main  # noqa: E402
from wrapopt.models.sources import resolve_model  # noqa: E402
from wrapopt.train import TrainConfig  # noqa: E402

WORLD = 4
# Llama 3.1 8B's config.json as released (the fields that shape the model).
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
            "torch_dtype": "bfloat16"}


def _tiny_llama(tmp_path) -> str:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=128, max_position_embeddings=64,
                                   architectures=["LlamaForCausalLM"]).to_dict()
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    path = os.path.join(tmp_path, "llama.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def test_a_bfloat16_config_trains_with_float32_master_weights_and_optimizer_state(tmp_path):
    src = resolve_model(f"hf:{_tiny_llama(tmp_path)}", batch=2, seq=16)
    model = src.build("meta")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert any("stored dtype (bfloat16)" in n and "not the training dtype" in n for n in src.notes)
    numel = sum(p.numel() for p in model.parameters())
    r = estimate(model, src.inputs, plan="no-shard", world_size=WORLD, train=TrainConfig.preset("bf16"))
    shard = r.mesh.shard_size
    per_elem = dict(r.estimate.peak_breakdown)["sharded_params"] * shard / numel
    assert per_elem == pytest.approx(4, rel=0.02), per_elem
    states = dict(r.estimate.peak_breakdown)["optimizer_state"]
    assert states * shard / numel == pytest.approx(8, rel=0.02)  # AdamW: 2 x fp32
    line = r.to_json()["training"]
    assert ("parameters float32 (master), compute bfloat16, reduction float32, optimizer state float32") in line


def test_the_training_line_names_the_four_dtypes(tmp_path, capsys):
    path = _tiny_llama(tmp_path)
    assert main(["estimate", f"hf:{path}", "--world-size", "2", "--precision", "bf16", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    training = next(ln for ln in out.splitlines() if ln.startswith("training:"))
    assert "parameters float32 (master), compute bfloat16, reduction float32, optimizer state float32" in training
    assert "stored dtype (bfloat16)" in out
    assert main(["estimate", f"hf:{path}", "--world-size", "2", "--precision", "bf16-pure", "--seq", "16"]) == 0
    assert "compute bfloat16, reduction bfloat16, optimizer state float32" in capsys.readouterr().out
    assert main(["search", f"hf:{path}", "--world-size", "2", "--precision", "bf16", "--seq", "16",
                 "--trials", "4"]) == 0
    out = capsys.readouterr().out
    assert "parameters float32 (master), compute bfloat16" in out
    assert "note: the config's stored dtype (bfloat16)" in out


def test_llama_3_1_8b_as_released_on_8_gpus_keeps_4_bytes_per_element(tmp_path, capsys):
    path = os.path.join(tmp_path, "llama-3.1-8b.json")
    with open(path, "w") as f:
        json.dump(LLAMA_8B, f)
    assert main(["estimate", f"hf:{path}", "--world-size", "8", "--gpus-per-node", "8", "--precision", "bf16",
                 "--seq", "8192", "--batch", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    numel = 8_030_261_248  # Llama 3.1 8B's parameter count
    assert d["peak_breakdown"]["sharded_params"] * 8 / numel == pytest.approx(4, rel=0.01)
    assert d["peak_breakdown"]["optimizer_state"] * 8 / numel == pytest.approx(8, rel=0.01)  # AdamW: 2 fp32 states


def test_show_names_the_stored_dtype_of_the_planned_model(tmp_path, capsys):
    plan = str(tmp_path / "plan.json")
    assert main(["search", "zoo:gpt-tiny", "--world-size", "2", "--trials", "4", "--precision", "bf16",
                 "--out", plan]) == 0
    capsys.readouterr()
    assert main(["show", plan]) == 0
    training = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("training:"))
    assert "parameters float32 (master), compute bfloat16, reduction float32, optimizer state float32" in training


def test_master_dtype_bfloat16_is_pure_bf16_training(tmp_path, capsys):
    """``--master-dtype bfloat16``: sharded parameters and AdamW state at 2 bytes per element,
    the training line and the notes say so (the "built in float32" note is gone), and the plan
    refuses a float32 model with the cast to make."""
    from wrapopt.errors import PlanMismatchError
    from wrapopt.plan.file import WrapPlan

    path = _tiny_llama(tmp_path)
    assert main(["estimate", f"hf:{path}", "--world-size", "2", "--precision", "bf16", "--seq", "16",
                 "--master-dtype", "bfloat16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    numel = sum(p.numel() for p in resolve_model(f"hf:{path}", seq=16).build("meta").parameters())
    shard = d["mesh"]["shard_size"] if "mesh" in d else 2
    assert d["peak_breakdown"]["sharded_params"] * shard / numel == pytest.approx(2, rel=0.02)
    assert d["peak_breakdown"]["optimizer_state"] * shard / numel == pytest.approx(4, rel=0.02)  # 2 bf16 states
    assert "parameters bfloat16 (master)" in d["training"] and "optimizer state bfloat16" in d["training"]
    plan = str(tmp_path / "pure.json")
    assert main(["search", f"hf:{path}", "--world-size", "2", "--precision", "bf16", "--seq", "16", "--trials", "0",
                 "--master-dtype", "bfloat16", "--out", plan]) == 0
    out = capsys.readouterr().out
    assert "master weights, gradients and optimizer state in bfloat16 (--master-dtype)" in out
    assert "is built in float32" not in out
    model = resolve_model(f"hf:{path}", seq=16).build("meta")  # float32, as hf: models are built
    with pytest.raises(PlanMismatchError, match=r"Only the dtype differs.*model.to\(torch.bfloat16\)"):
        WrapPlan.load(plan).check_model(model)
    WrapPlan.load(plan).check_model(model.to(torch.bfloat16))  # cast: the planned model
