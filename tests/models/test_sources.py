"""MODEL strings resolve through the registry of prefixes (models/sources.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from wrapopt.errors import ModelError
from wrapopt.models.base import ModelSource
from wrapopt.models.sources import SOURCES, register_source, resolve_model


def test_zoo_and_hf_are_registered_prefixes():
    assert {"zoo", "hf"} <= set(SOURCES)
    src = resolve_model("zoo:gpt-tiny", batch=3)
    assert src.name == "zoo:gpt-tiny" and src.inputs[0].shape[0] == 3


def test_a_new_prefix_is_one_registration(monkeypatch):
    monkeypatch.setitem(SOURCES, "toy", SOURCES["zoo"])  # restored after the test

    def toy(rest: str, batch, seq) -> ModelSource:
        width = int(rest)
        return ModelSource(f"toy:{rest}", lambda device: nn.Linear(width, width, device=device),
                           (torch.randn(batch or 2, width),), None, True)

    register_source("toy", toy)
    src = resolve_model("toy:8")
    assert src.build("meta").weight.shape == (8, 8) and src.inputs[0].shape == (2, 8)


def test_unknown_model_string_lists_what_is_accepted():
    with pytest.raises(ModelError, match=r"zoo:\.\.\., hf:\.\.\..*package\.module:callable"):
        resolve_model("gpt-tiny")
    with pytest.raises(ValueError, match="a word"):
        register_source("no good", SOURCES["zoo"])


def test_old_import_paths_still_work_for_one_release():
    import wrapopt.debug
    import wrapopt.spec
    from wrapopt.inspect import full_tensor, memory_report  # noqa: F401
    from wrapopt.types import MeshSpec

    assert MeshSpec is wrapopt.spec.MeshSpec
    assert full_tensor is wrapopt.debug.full_tensor
