"""``wrapopt trace MODEL``: the module tree with parameters, FLOPs and saved activations."""

from __future__ import annotations

import argparse
import json
from typing import Any

from wrapopt.cli.options import add_model_arguments, count_int, model_from_args
from wrapopt.errors import OptionError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt trace`` to the CLI's sub-commands; it runs ``run``."""
    p = subparsers.add_parser("trace", help="print the module tree with parameters, FLOPs and activations")
    add_model_arguments(p, optional=True)
    p.add_argument("--list", action="store_true", help="list the zoo models (zoo:NAME) and stop")
    p.add_argument("--depth", type=count_int, default=2, help="fold the tree below this depth (default 2)")
    p.add_argument("--json", action="store_true", help="print the graph as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    """Body of ``wrapopt trace``: the zoo with ``--list``, else MODEL's tree."""
    from wrapopt.models import zoo
    from wrapopt.report.text import format_graph, graph_to_json
    from wrapopt.trace.meta import trace_model

    if args.list:
        width = max(map(len, zoo.ZOO))
        for name, entry in zoo.ZOO.items():
            print(f"zoo:{name:<{width}}  {entry.description}")
        return 0
    if args.model is None:
        raise OptionError("give MODEL (zoo:NAME, package.module:callable or hf:config.json), or --list for the zoo")
    src = model_from_args(args)
    graph = trace_model(src.build("meta"), src.inputs, loss_fn=src.loss)
    if args.json:
        print(json.dumps(graph_to_json(graph), indent=1))
    else:
        print(format_graph(graph, depth=args.depth))
    return 0
