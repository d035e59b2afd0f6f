"""fingerprint.py: what a plan records of the model it was made for."""

from __future__ import annotations

from wrapopt.fingerprint import model_fingerprint


def test_fingerprint_records_module_classes(gpt_tiny):
    model, _, _ = gpt_tiny
    classes = model_fingerprint(model)["module_classes"]
    assert classes["wrapopt.models.zoo.GPTBlock"] == [f"layers.{i}" for i in range(4)]
    assert classes["wrapopt.models.zoo.GPT"] == [""]
