"""The exporter table (interop/registry.py): every row loads its function, the CLI offers and
describes exactly the rows, and an unknown target names the known ones."""

from __future__ import annotations

import argparse

import pytest

from tests.ranks import MESH2
from wrapopt.cli import export as export_cli
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop import EXPORTERS, TARGETS, export_plan
from wrapopt.interop.registry import Exporter, get_exporter
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import make_plan


def test_every_row_loads_a_function_named_after_its_module():
    assert TARGETS == tuple(EXPORTERS) and len(set(TARGETS)) == len(TARGETS)
    for name, row in EXPORTERS.items():
        assert isinstance(row, Exporter) and row.name == name and row.help and "\n" not in row.help
        fn = row.load()
        assert callable(fn) and f"{fn.__module__}:{fn.__name__}" == row.function


def test_the_cli_offers_and_describes_every_target():
    sub = argparse.ArgumentParser(prog="wrapopt").add_subparsers()
    p = export_cli.add_parser(sub)
    to = next(a for a in p._actions if a.dest == "to")
    assert tuple(to.choices) == TARGETS
    assert all(f"{name}: {row.help}" in to.help for name, row in EXPORTERS.items())


def test_an_unknown_target_lists_the_known_ones(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = WrapPlan(spec=make_plan(graph, MESH2, list(graph.blocks)), model=model_fingerprint(model))
    with pytest.raises(ValueError, match="choose one of: " + ", ".join(TARGETS)):
        export_plan(plan, to="deepspeed")
    with pytest.raises(ValueError, match="cannot export to 'x'"):
        get_exporter("x")


def test_lightning_is_lightning_fsdp2(gpt_tiny):
    model, _, graph = gpt_tiny
    plan = WrapPlan(spec=make_plan(graph, MESH2, list(graph.blocks)), model=model_fingerprint(model))
    a, b = export_plan(plan, to="lightning"), export_plan(plan, to="lightning-fsdp2")
    assert a == b and a.target == "lightning-fsdp2" and a.exact
