"""``wrapopt fabric --list | --template | FILE``: the analytical fabrics, built in or stated in a file."""

from __future__ import annotations

import argparse
import json
from typing import Any

from wrapopt.hardware.presets import (
    ANALYTICAL_FABRICS,
    DEFAULT_ANALYTICAL,
    TEMPLATE,
    analytical_fabric,
    load_analytical,
)
from wrapopt.report.fabric import format_stated

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Body of ``wrapopt fabric``: the template, a file checked, or the built-in fabrics."""
    if args.template:
        print(json.dumps(TEMPLATE, indent=2))
        return 0
    if args.file:
        print(format_stated(load_analytical(args.file, world_size=1)))
        return 0
    for name in ANALYTICAL_FABRICS:
        default = "   (default)" if name == DEFAULT_ANALYTICAL else ""
        print(format_stated(analytical_fabric(name, world_size=1)) + default)
    print("Describe your own cluster: `wrapopt fabric --template > my.json`, edit it, pass --fabric my.json.")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt fabric`` to the CLI's sub-commands; it runs ``run``."""
    p = subparsers.add_parser("fabric", help="list the built-in analytical fabrics, or check a file of stated numbers")
    p.add_argument("file", nargs="?", default=None, help="a file of stated numbers to check and show")
    p.add_argument("--list", action="store_true", help="print the built-in analytical fabrics (the default)")
    p.add_argument("--template", action="store_true", help="print a file of stated numbers to edit")
    return p
