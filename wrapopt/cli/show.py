"""``wrapopt show FILE``: a plan or a fabric profile, as text or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from wrapopt.fileio import read_json

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt show`` to the CLI's sub-commands; it runs ``run``."""
    p = subparsers.add_parser("show", help="print a plan or fabric profile")
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeline", default=None, help="draw the predicted step timeline of a plan to this PNG")
    return p


def run(args: argparse.Namespace) -> int:
    """Body of ``wrapopt show``: a fabric profile or a file of stated numbers by its format, else a plan."""
    from wrapopt.hardware.presets import analytical_from_json
    from wrapopt.hardware.profiles import FabricProfile
    from wrapopt.plan.file import WrapPlan
    from wrapopt.report.fabric import format_fabric, format_stated
    from wrapopt.report.plots import draw_timeline
    from wrapopt.report.text import format_plan

    data: Any = read_json(args.file)
    fmt = data.get("format") if isinstance(data, dict) else None
    if isinstance(fmt, str) and fmt.startswith("wrapopt.analytical/"):  # the reader names the version it reads
        print(format_stated(analytical_from_json(data, source=args.file, world_size=1)))
        return 0
    if isinstance(fmt, str) and fmt.startswith("wrapopt.fabric/"):
        prof = FabricProfile.from_json(data, source=args.file)
        if args.json:
            print(json.dumps(prof.to_json(), indent=1))
        else:
            print(format_fabric(prof))
        return 0
    plan = WrapPlan.from_json(data, source=args.file)
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        print(format_plan(plan))
    if args.timeline:
        draw_timeline(plan, args.timeline)
        print(f"wrote {args.timeline}")
    return 0
