"""``wrapopt export``: a plan as the configuration of a framework; the targets are the rows of
``wrapopt.interop.registry.EXPORTERS`` (an Accelerate config, Lightning strategies for FSDP2 and FSDP1,
a module wrapping with FSDP1, a TorchTitan job config)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from wrapopt.fileio import atomic_write_text, check_writable
from wrapopt.interop.registry import TARGETS, targets_help

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt export`` to the CLI's sub-commands; it runs ``run``."""
    p = subparsers.add_parser("export", help="write a plan for Accelerate, Lightning, plain FSDP1 or TorchTitan",
                              description="Write the configuration or module a training tool reads for a plan; "
                                          "what the tool cannot express is listed under LOSSES, what the training "
                                          "script must do under TO RUN THE PLAN (both also on stderr).")
    p.add_argument("plan", help="a plan file (wrapopt search --out)")
    p.add_argument("--to", required=True, choices=TARGETS, help=targets_help())
    p.add_argument("--out", default=None, help="write here (default: print to stdout)")
    p.add_argument("--model", default=None,
                   help="the planned MODEL (zoo:NAME, package.module:callable, hf:config.json); needed only for "
                        "plan files that do not record module classes")
    p.add_argument("--json", action="store_true", help="print the settings and losses as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 without writing when the export loses anything")
    return p


def run(args: argparse.Namespace) -> int:
    """Body of ``wrapopt export``; library errors propagate (the CLI turns them into exit 1)."""
    from wrapopt.interop.export import export_plan
    from wrapopt.models.sources import resolve_model
    from wrapopt.plan.check import check_plan
    from wrapopt.plan.file import WrapPlan

    plan = WrapPlan.load(args.plan)
    model = None
    if args.model:
        model = resolve_model(args.model).build("meta")
    check_plan(plan, model=model)  # See [Note: one plan check] in plan/check.py
    if args.out:
        check_writable(args.out)
    out = export_plan(plan, to=args.to, model=model, source=args.plan, out=args.out)
    if out.script:
        print(f"wrapopt export: to run the plan with {args.to}, the training script or launch must:", file=sys.stderr)
        for x in out.script:
            print(f"  - {x}", file=sys.stderr)
    if out.losses:
        print(f"wrapopt export: the {args.to} configuration does not reproduce the plan exactly:", file=sys.stderr)
        for x in out.losses:
            print(f"  - {x}", file=sys.stderr)
        if args.strict:
            print("wrapopt export: nothing written (--strict)", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"target": out.target, "exact": out.exact, "settings": out.settings,
                          "losses": list(out.losses), "script": list(out.script), "fields": out.fields}, indent=1))
    if args.out:
        atomic_write_text(args.out, out.text)
        print(f"wrote {args.out}" + ("" if out.exact else f" ({len(out.losses)} losses listed in it)"), file=sys.stderr)
    elif not args.json:
        print(out.text, end="")
    return 0
