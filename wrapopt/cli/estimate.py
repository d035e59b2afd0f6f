"""``wrapopt estimate MODEL --plan per-block|size-1e8|no-shard|plan.json``: one plan's predicted step,
at a tensor-parallel degree (``--tp N``) or on a pipeline (``--pp``) if asked."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from typing import Any

from wrapopt.choices import BASELINE_NAMES
from wrapopt.cli.options import (add_mesh_arguments, add_model_arguments, add_pp_argument, add_train_arguments,
                                 fabric_from_args, model_from_args, positive_int, train_from_args,
                                 with_global_batch)
from wrapopt.errors import OptionError
from wrapopt.spec.plan import SELECTIVE_OP

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Body of ``wrapopt estimate``: a plan file brings its own training step unless a flag is given."""
    from wrapopt.api import estimate
    from wrapopt.report.estimate import format_estimate

    given_flags = {"--precision": args.precision is not None, "--accumulation": args.accumulation != 1,
                   "--optimizer": args.optimizer != "adamw", "--sync": args.sync != "auto"}
    train = with_global_batch(args, train_from_args(args))
    is_file = os.path.exists(args.plan)
    if not is_file and args.plan not in BASELINE_NAMES:
        raise OptionError(f"unknown --plan {args.plan!r}; accepted: {', '.join(BASELINE_NAMES)}, or a plan file "
                         "(no such file)")
    # A plan file brings its own training step unless a training flag is given.
    if is_file and not any(given_flags.values()) and train.micro_batch is None:
        train = None
    src = model_from_args(args)
    report = estimate(src.build("meta"), src.inputs, plan=args.plan, world_size=args.world_size,
                      gpus_per_node=args.gpus_per_node, fabric=fabric_from_args(args), compute=args.compute,
                      train=train,
                      checkpoint=args.checkpoint, memory_budget=args.memory, loss_fn=src.loss,
                      rescale_fabric=args.rescale_fabric, name=args.model, global_batch=args.global_batch,
                      pp=args.pp, tp=args.tp)
    report = replace(report, notes=(*src.notes, *report.notes))
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(report.budget_note)
        print(format_estimate(report))
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt estimate`` to the CLI's sub-commands; it runs ``run``."""
    p = subparsers.add_parser("estimate", help="predict step time, throughput, MFU and peak memory of a plan you have")
    add_model_arguments(p)
    p.add_argument("--plan", default="per-block",
                   help=f"a baseline ({', '.join(BASELINE_NAMES)}) or a plan file (plan.json); default per-block")
    add_mesh_arguments(p, world_required=False)
    add_train_arguments(p)
    p.add_argument("--checkpoint", choices=("none", "blocks", "full", SELECTIVE_OP), default=None,
                   help="activation checkpointing of every unit but the root: blocks (or full) recomputes each "
                        f"whole, {SELECTIVE_OP} keeps the matmul and attention outputs and recomputes the rest "
                        "(TorchTitan's selective op AC), none (default: as the plan says)")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor-parallel degree inside each node (2-D, as TorchTitan): the baseline on the "
                        "data-parallel ranks, its blocks split by the TP plan wrapopt recognises, as search --tp "
                        "scores it (default 1; a plan file keeps its own degree)")
    add_pp_argument(p, what="the per-block plan on balanced stages with the fastest schedule and micro-batches; auto: "
                             "the fastest of 2, 4, 8, 16")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p
