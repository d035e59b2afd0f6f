"""``wrapopt fabric --list | --template | FILE``: the analytical fabrics, built in or stated in a file."""

from __future__ import annotations

import argparse
import json

from wrapopt.fileio import fmt_bytes
from wrapopt.hardware.presets import ANALYTICAL_FABRICS, DEFAULT_ANALYTICAL, TEMPLATE, analytical_fabric, load_analytical
from wrapopt.hardware.profiles import FabricProfile

__all__ = ["add_fabric_parser", "format_stated"]


def format_stated(f: FabricProfile) -> str:
    """One analytical fabric's stated numbers, a few lines."""
    c = f.meta.get("compute", {})
    peaks = c.get("peak_flops_per_s") or {}
    rate = ", ".join(f"{k} {v / 1e12:g}" for k, v in peaks.items()) or f"{c.get('flops_per_s', 0) / 1e12:g} achieved"
    lines = [f"{f.name}: {f.meta.get('description', '')}",
             f"  {f.meta.get('gpus_per_node', f.ranks_per_node)} GPUs per node; "
             f"intra-node {f.intra.bandwidth_bytes_per_s / 1e9:g} GB/s per GPU, {f.intra.latency_s * 1e6:g} us per step; "  # type: ignore[union-attr]
             f"inter-node {f.inter.bandwidth_bytes_per_s / 1e9:g} GB/s per GPU, {f.inter.latency_s * 1e6:g} us per step",  # type: ignore[union-attr]
             f"  peak TFLOP/s: {rate}; achievable {c.get('achievable_fraction', '-')}; memory "
             f"{fmt_bytes(c.get('memory_capacity_bytes') or 0)} at {c.get('memory_bandwidth_bytes_per_s', 0) / 1e12:g} TB/s"]
    return "\n".join(lines)


def _cmd_fabric(args: argparse.Namespace) -> int:
    if args.template:
        print(json.dumps(TEMPLATE, indent=2))
        return 0
    if args.file:
        print(format_stated(load_analytical(args.file, world_size=1)))
        return 0
    for name in ANALYTICAL_FABRICS:
        print(format_stated(analytical_fabric(name, world_size=1)) + ("   (default)" if name == DEFAULT_ANALYTICAL else ""))
    print("Describe your own cluster: `wrapopt fabric --template > my.json`, edit it, pass --fabric my.json.")
    return 0


def add_fabric_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fabric", help="list the built-in analytical fabrics, or check a file of stated numbers")
    p.add_argument("file", nargs="?", default=None, help="a file of stated numbers to check and show")
    p.add_argument("--list", action="store_true", help="print the built-in analytical fabrics (the default)")
    p.add_argument("--template", action="store_true", help="print a file of stated numbers to edit")
    p.set_defaults(func=_cmd_fabric)
