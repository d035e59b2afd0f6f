"""``wrapopt fabric --list | --template | FILE``: the analytical fabrics, built in or stated in a file."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Body of ``wrapopt fabric``: the template, a file checked, or the built-in fabrics."""
    from wrapopt.hardware.catalog import GPU_TEMPLATE, GPUS, INTER_LINKS, INTRA_LINKS
    from wrapopt.hardware.presets import (
        ANALYTICAL_FABRICS,
        DEFAULT_ANALYTICAL,
        NETWORK_TEMPLATE,
        TEMPLATE,
        analytical_fabric,
        load_analytical,
    )
    from wrapopt.report.fabric import format_stated

    for flag, template in ((args.template, TEMPLATE), (args.template_gpu, GPU_TEMPLATE),
                           (args.template_network, NETWORK_TEMPLATE)):
        if flag:
            print(json.dumps(template, indent=2))
            return 0
    if args.file:
        print(format_stated(load_analytical(args.file, world_size=1)))
        return 0
    for name in ANALYTICAL_FABRICS:
        default = "   (default)" if name == DEFAULT_ANALYTICAL else ""
        print(format_stated(analytical_fabric(name, world_size=1)) + default)
    print("GPU presets (--gpu):")
    for g in GPUS.values():
        print(f"  {g.name:14} {g.description}; {g.source}; GEMMs at {g.matmul_fraction:g} and attention at "
              f"{g.attention_fraction:g} of peak ({g.fit_source})")
    print("Networks (--network): between nodes " + "; ".join(f"{k}: {v.source}" for k, v in INTER_LINKS.items()))
    print("  inside the node (INSIDE-BETWEEN, e.g. nvlink4-ib400; default: the GPU's own): "
          + "; ".join(f"{k}: {v.source}" for k, v in INTRA_LINKS.items()))
    print("Describe your own cluster: `wrapopt fabric --template > my.json`, edit it, pass --fabric my.json.")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt fabric`` to the CLI's sub-commands; it runs ``run``."""
    p = subparsers.add_parser("fabric", help="list the built-in analytical fabrics, or check a file of stated numbers")
    p.add_argument("file", nargs="?", default=None, help="a file of stated numbers to check and show")
    p.add_argument("--list", action="store_true", help="print the built-in analytical fabrics (the default)")
    p.add_argument("--template", action="store_true", help="print a file of stated numbers to edit")
    p.add_argument("--template-gpu", action="store_true", help="print a GPU's stated numbers to edit (--gpu FILE)")
    p.add_argument("--template-network", action="store_true",
                   help="print a network's stated numbers to edit (--network FILE)")
    return p
