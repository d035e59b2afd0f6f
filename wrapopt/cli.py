"""``wrapopt`` command line: argparse sub-commands, ``main(argv) -> int``.

Library errors (``WrapoptError``) become exit code 1 and one line on stderr;
argument errors exit 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["main"]


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="zoo:NAME, package.module:callable, or hf:path/to/config.json")
    p.add_argument("--batch", type=int, default=None, help="per-rank batch for the example inputs")
    p.add_argument("--seq", type=int, default=None, help="sequence length (token models)")


def _cmd_trace(args: argparse.Namespace) -> int:
    from wrapopt.models import resolve_model
    from wrapopt.report import format_graph, graph_to_json
    from wrapopt.trace import trace_model

    src = resolve_model(args.model, batch=args.batch, seq=args.seq)
    graph = trace_model(src.build("meta"), src.inputs, loss_fn=src.loss)
    if args.json:
        print(json.dumps(graph_to_json(graph), indent=1))
    else:
        print(format_graph(graph, depth=args.depth))
    return 0


def _mesh(args: argparse.Namespace):
    from wrapopt.types import MeshSpec

    gpn = args.gpus_per_node or min(args.world_size, 8)
    if args.world_size < 1:
        raise ValueError(f"--world-size must be positive, got {args.world_size}")
    if args.world_size > gpn and args.world_size % gpn:
        raise ValueError(f"--world-size {args.world_size} is not a multiple of --gpus-per-node {gpn}")
    return MeshSpec(world_size=args.world_size, ranks_per_node=min(gpn, args.world_size), shard_size=args.world_size)


def _cmd_search(args: argparse.Namespace) -> int:
    from wrapopt._io import check_writable
    from wrapopt.api import _budget, check_fabric_fits, format_report, plan_model, resolve_fabric
    from wrapopt.fabric import ComputeProfile
    from wrapopt.models import resolve_model
    from wrapopt.trace import trace_model

    mesh = _mesh(args)
    if args.out:
        check_writable(args.out)
    fabric = resolve_fabric(args.fabric, world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node)
    notes = check_fabric_fits(fabric, mesh, rescale=args.rescale_fabric)
    if args.compute:
        compute = ComputeProfile.load(args.compute)
    elif fabric.kind == "analytical":
        compute = ComputeProfile.analytical(fabric.name)
    else:
        from wrapopt.profile import measure_compute

        compute = measure_compute()
    src = resolve_model(args.model, batch=args.batch, seq=args.seq)
    model = src.build("meta")
    graph = trace_model(model, src.inputs, loss_fn=src.loss)
    budget = _budget(args.memory, compute)
    plan, result = plan_model(graph, model, mesh=mesh, fabric=fabric, compute=compute, memory_budget=budget, notes=notes)
    if args.out:
        plan.save(args.out)
    if args.json:
        out = plan.to_json()
        out.pop("model", None)
        out["model"] = {k: v for k, v in plan.model.items() if k not in ("params", "module_classes")}
        print(json.dumps(out, indent=1))
    else:
        print(format_report(result, fabric, compute, mesh))
        if args.out:
            print(f"wrote {args.out}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from wrapopt._io import read_json
    from wrapopt.fabric import FabricProfile
    from wrapopt.plan import WrapPlan
    from wrapopt.report import format_plan

    data: Any = read_json(args.file)
    fmt = data.get("format") if isinstance(data, dict) else None
    if isinstance(fmt, str) and fmt.startswith("wrapopt.fabric/"):
        prof = FabricProfile.from_json(data, source=args.file)
        if args.json:
            print(json.dumps(prof.to_json(), indent=1))
        else:
            from wrapopt.profile import format_fabric

            print(format_fabric(prof))
        return 0
    plan = WrapPlan.from_json(data, source=args.file)
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        print(format_plan(plan))
    if args.timeline:
        from wrapopt.report import draw_timeline

        draw_timeline(plan, args.timeline)
        print(f"wrote {args.timeline}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from wrapopt.demo import run_demo

    return run_demo(out_dir=args.out, model=args.model, world_size=args.world_size, repeats=args.repeats,
                    memory_budget=args.memory)


def _cmd_profile(args: argparse.Namespace) -> int:
    from wrapopt.profile import run_cli

    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    from wrapopt import __version__

    parser = argparse.ArgumentParser(prog="wrapopt", description="Find and apply the best FSDP wrapping plan.")
    parser.add_argument("--version", action="version", version=f"wrapopt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile-fabric", help="measure collective latency per size on each mesh axis")
    from wrapopt.profile import add_cli_arguments

    add_cli_arguments(p)
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("trace", help="print the module tree with parameters, FLOPs and activations")
    _model_args(p)
    p.add_argument("--depth", type=int, default=2, help="fold the tree below this depth (default 2)")
    p.add_argument("--json", action="store_true", help="print the graph as JSON")
    p.set_defaults(func=_cmd_trace)

    p = sub.add_parser("search", help="search the best plan for a model on a mesh")
    _model_args(p)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (default: min(world, 8))")
    p.add_argument("--fabric", default=None,
                   help="fabric profile JSON, or an analytical fabric name (default: h100-nvlink-ib400, analytical)")
    p.add_argument("--compute", default=None, help="compute profile JSON (default: matches the fabric)")
    p.add_argument("--memory", default=None, help="per-rank budget: bytes, 80GiB, 80GB, or auto (90%% of the device)")
    p.add_argument("--rescale-fabric", action="store_true", help="allow a measured profile from another mesh, rescaled")
    p.add_argument("--out", default=None, help="write the plan here (JSON)")
    p.add_argument("--json", action="store_true", help="print the plan and baselines as JSON")
    p.set_defaults(func=_cmd_search)

    p = sub.add_parser("show", help="print a plan or fabric profile")
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeline", default=None, help="draw the predicted step timeline of a plan to this PNG")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("demo", help="the whole job end to end on 2 local gloo ranks")
    p.add_argument("--out", default="results/demo")
    p.add_argument("--model", default="gpt-tiny", help="a trainable zoo model")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory", default=None, help="budget (default: midway between the baselines' peaks)")
    p.set_defaults(func=_cmd_demo)

    from wrapopt.evidence import add_bench_parser
    from wrapopt.export import add_export_parser

    add_bench_parser(sub)
    add_export_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from wrapopt.errors import WrapoptError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (WrapoptError, ValueError, OSError) as e:
        print(f"wrapopt {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    sys.exit(main())
