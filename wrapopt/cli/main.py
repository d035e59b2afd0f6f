"""``wrapopt`` command line: argparse sub-commands, ``main(argv) -> int``.

Every sub-command is a module of this package with two functions:
``add_parser(subparsers) -> ArgumentParser`` adds its parser and options, and
``run(args) -> int`` is its body. ``COMMANDS`` lists them in the order
``wrapopt --help`` shows them; ``build_parser`` registers each the same way.

Library errors (``WrapoptError``) become exit code 1 and one line on stderr;
argument errors (a value a flag's ``type=`` refuses, a missing argument) exit 2,
argparse's convention, also with one line, naming the argument and pointing to
``--help`` (the usage of a sub-command is many lines, and would bury the error).
"""

# [Note: first contact]
# Importing torch takes seconds, and ``wrapopt --help``, ``wrapopt CMD --help`` and an argument
# error only build the parsers. So the modules a parser needs import no torch: this package's
# modules import, at their top, only argparse and light wrapopt modules (``errors``, ``fileio``,
# ``checks``, ``spec``, ``tp``, ``choices``, ``interop.registry``), and each ``run`` imports the
# library it calls in its body. The names and defaults a parser shows (precisions, optimizers,
# baselines, plan sets, export targets) are defined in those light modules, and the library
# modules that use them import them from there. The root package imports nothing heavy either
# (See [Note: a lazy root package] in wrapopt/__init__.py). tests/cli/test_first_contact.py
# checks that every command's --help and an argument error leave torch out of sys.modules.

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

from wrapopt.cli import bench, demo, estimate, export, fabric, profile_fabric, search, show, trace_graph
from wrapopt.cli.logs import VERBOSE_HELP
from wrapopt.errors import WrapoptError
from wrapopt.version import __version__

__all__ = ["main", "build_parser", "COMMANDS"]

# The sub-commands, each a module with ``add_parser(subparsers)`` and ``run(args) -> int``.
COMMANDS = (
    profile_fabric,  # wrapopt profile-fabric: measure the fabric
    trace_graph,  # wrapopt trace: the module tree
    search,  # wrapopt search: the best plan
    show,  # wrapopt show: a plan or fabric file
    demo,  # wrapopt demo: the whole job on local ranks
    bench,  # wrapopt bench: measured steps against the baselines
    export,  # wrapopt export: a plan for Accelerate or Lightning
    estimate,  # wrapopt estimate: one plan's predicted step
    fabric,  # wrapopt fabric: the analytical fabrics
)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with one-line errors (sub-command parsers are made of the same class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="wrapopt", description="Find and apply the best FSDP wrapping plan.")
    parser.add_argument("--version", action="version", version=f"wrapopt {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = command.add_parser(sub)
        p.set_defaults(func=command.run)
        # -v after the sub-command too; SUPPRESS keeps one given before it
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


# Options whose value may start with "-" (a negative size): argparse reads "--memory -10GiB" as a
# missing value before another option, so such a pair is joined as "--memory=-10GiB" and the
# value reaches its own check, which says what is wrong with it.
_SIGNED = ("--memory",)


def _join_signed(argv: list[str]) -> list[str]:
    out: list[str] = []
    for tok in argv:
        if out and out[-1] in _SIGNED and re.fullmatch(r"-[0-9.].*", tok):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_join_signed(list(sys.argv[1:] if argv is None else argv)))
    try:
        return int(args.func(args) or 0)
    except (WrapoptError, ValueError, OSError) as e:
        print(f"wrapopt {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
