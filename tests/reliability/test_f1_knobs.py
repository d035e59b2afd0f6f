"""The throughput knobs said wrongly or where they cannot run (issue 52): one line each, naming the
field or flag and what to do; and the knobs as the plan file, the CLI and ``--current`` say them."""

from __future__ import annotations

import argparse

import pytest

from wrapopt.cli.options import add_train_arguments, train_from_args
from wrapopt.errors import OptionError, PlanError
from wrapopt.plan.schema import schema_errors
from wrapopt.search.current_items import current_error as _fail, read_items as _read_items
from wrapopt.search.current_knobs import knobs_said
from wrapopt.train import TrainConfig


def _flags(*argv: str) -> TrainConfig:
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return train_from_args(p.parse_args(list(argv)))


def test_the_knobs_round_trip_through_the_plan_file_and_old_files_load_off():
    t = TrainConfig.preset("bf16", compile=True, float8="tensorwise", float8_all_gather=True)
    d = t.to_json()
    assert TrainConfig.from_json(d) == t
    assert not [e for e in schema_errors({"train": d}) if e[0].startswith("train")]
    old = {k: v for k, v in d.items() if k not in ("compile", "float8", "float8_all_gather")}
    assert TrainConfig.from_json(old) == TrainConfig.preset("bf16")
    assert "compile" not in TrainConfig.preset("bf16").to_json()  # off: absent, as older files wrote
    assert "float8 tensorwise (float8 all-gather), compiled per block" in t.describe()


def test_cli_flags_make_the_knobs():
    t = _flags("--compile", "--float8", "rowwise")
    assert (t.compile, t.float8, t.float8_all_gather) == (True, "rowwise", False)
    assert _flags().float8 == "none" and not _flags().compile


@pytest.mark.parametrize("kw, words", [
    ({"float8_all_gather": True}, ["--float8-all-gather", "--float8 tensorwise"]),
    ({"float8": "rowwise", "float8_all_gather": True}, ["--float8-all-gather", "tensorwise"]),
    ({"float8": "e4m3"}, ["--float8", "tensorwise, rowwise"]),
])
def test_bad_knobs_are_refused_in_one_line(kw, words):
    with pytest.raises(OptionError) as e:
        TrainConfig(**kw)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words)


def test_a_plan_file_with_a_bad_knob_names_the_file_and_field():
    with pytest.raises(PlanError, match=r"^plan\.json: train: .*float8"):
        TrainConfig.from_json({"float8": "fp4"}, source="plan.json")
    with pytest.raises(PlanError, match=r"^plan\.json: train: compile must be true or false"):
        TrainConfig.from_json({"compile": "yes"}, source="plan.json")


def _said(text: str):
    return knobs_said(text, _read_items(text, {"per-block": None}), _fail)


def test_current_reads_the_knobs_as_users_say_them():
    assert _said("per-block, compile, float8 rowwise") == (("compile", True), ("float8", "rowwise"))
    assert dict(_said("torch.compile, fp8, float8 all-gather")) == {
        "compile": True, "float8": "tensorwise", "float8_all_gather": True}
    assert _said("per-block") == ()


@pytest.mark.parametrize("text, words", [
    ("compile, eager", ["'compile' and 'eager' contradict"]),
    ("float8 all-gather", ["needs tensorwise float8", "add float8 tensorwise"]),
    ("float8 rowwise, float8 tensorwise", ["contradict"]),
])
def test_current_refuses_knobs_that_cannot_be_one_job(text, words):
    with pytest.raises(OptionError) as e:
        _said(text)
    assert all(w in str(e.value) for w in words)
