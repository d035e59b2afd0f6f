"""MODEL strings resolve through the registry of prefixes (models/sources.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from wrapopt.errors import OptionError, ModelError
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


_USER_MODULE = '''
import torch
import torch.nn as nn

def broken():
    raise RuntimeError("CUDA out of memory\\nsecond line")

def ok():
    return nn.Linear(4, 4), torch.randn(2, 4)

CALLS = []

def fails_on_build():
    CALLS.append(1)
    if len(CALLS) > 1:
        raise KeyError("weights")
    return ok()
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "rel2_user_models.py").write_text(_USER_MODULE)
    (tmp_path / "rel2_bad_import.py").write_text("raise ValueError('no config here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "rel2_user_models"


def test_a_callable_that_raises_is_one_line_naming_it_the_error_and_the_fix(user_module):
    with pytest.raises(ModelError) as err:
        resolve_model(f"{user_module}:broken")
    msg = str(err.value)
    assert f"calling {user_module}.broken() raised RuntimeError: CUDA out of memory;" in msg and "\n" not in msg
    assert "returns (model, example_inputs)" in msg
    src = resolve_model(f"{user_module}:fails_on_build")  # the probe works; building again fails
    with pytest.raises(ModelError, match=r"fails_on_build\(\) raised KeyError: 'weights'"):
        src.build("meta")
    assert resolve_model(f"{user_module}:ok").build("meta").weight.is_meta


def test_a_module_that_raises_on_import_is_one_line(user_module):
    with pytest.raises(ModelError) as err:
        resolve_model("rel2_bad_import:anything")
    assert "importing 'rel2_bad_import' raised ValueError: no config here" in str(err.value)
    assert "\n" not in str(err.value)


def test_zoo_seq_beyond_the_positions_is_an_error_naming_the_limit():
    with pytest.raises(OptionError, match=r"--seq 8192 is past zoo:llama-7b's limit of 4096 tokens"):
        resolve_model("zoo:llama-7b", batch=1, seq=8192)
    assert resolve_model("zoo:gpt-tiny", batch=1, seq="context").inputs[0].shape == (1, 64)
    assert resolve_model("zoo:gpt-tiny", batch=1, seq=16).inputs[0].shape == (1, 16)
