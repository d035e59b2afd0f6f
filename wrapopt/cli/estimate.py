"""``wrapopt estimate MODEL --plan per-block|size-1e8|no-shard|plan.json``: one plan's predicted step,
at a tensor-parallel degree (``--tp N``) or on a pipeline (``--pp``) if asked."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from typing import Any

from wrapopt.choices import BASELINE_NAMES
from wrapopt.cli.options import (add_cp_ep_arguments, add_mesh_arguments, add_model_arguments, add_pp_argument,
                                 add_train_arguments, fabric_from_args, model_from_args, positive_int, sync_note,
                                 train_from_args, with_global_batch)
from wrapopt.errors import OptionError
from wrapopt.spec.plan import SELECTIVE_OP

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    """Body of ``wrapopt estimate``: See [Note: the step estimate scores]."""
    from wrapopt.api import estimate
    from wrapopt.report.estimate import format_estimate

    is_file = os.path.exists(args.plan)
    if not is_file and args.plan not in BASELINE_NAMES:
        raise OptionError(f"unknown --plan {args.plan!r}; accepted: {', '.join(BASELINE_NAMES)}, or a plan file "
                         "(no such file)")
    train, global_batch, notes = _step(args, _recorded_step(args.plan) if is_file else None)
    src = model_from_args(args)
    report = estimate(src.build("meta"), src.inputs, plan=args.plan, world_size=args.world_size,
                      gpus_per_node=args.gpus_per_node, fabric=fabric_from_args(args), compute=args.compute,
                      train=train,
                      checkpoint=args.checkpoint, memory_budget=args.memory, loss_fn=src.loss,
                      rescale_fabric=args.rescale_fabric, name=args.model, global_batch=global_batch,
                      pp=args.pp, tp=args.tp, cp=args.cp, ep=args.ep)
    notes += sync_note(args.sync, report.train.grad_accumulation, pipeline=report.pipeline_microbatches is not None)
    report = replace(report, notes=(*src.notes, *notes, *report.notes))
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(report.budget_note)
        print(format_estimate(report))
    return 0


# [Note: the step estimate scores] ``wrapopt estimate`` scores the step a job runs:
# - a plan file brings its own step (``"train"``: precision, optimizer, micro-batch x accumulation,
#   sync mode); each training flag given replaces its field alone, so ``--precision bf16`` keeps the
#   plan's batch split. ``--global-batch`` equal to the plan's keeps the plan's own split (that
#   micro-batch x accumulation x ranks is what the plan was chosen at); another global batch is
#   split again, the fastest split that fits (``score_splits``). ``--batch`` or ``--accumulation``
#   fix a split of their own.
# - the gradient sync under accumulation is what a plain FSDP2 loop does unless told otherwise:
#   every micro-batch reduce-scatters. ``--sync last`` (or ``auto``: the faster that fits, as the
#   search scores) says otherwise, and so does a plan file's recorded mode.
def _recorded_step(path: str) -> Any:
    """The plan file's training step (None when it records none)."""
    from wrapopt.plan.file import WrapPlan

    plan = WrapPlan.load(path)
    return plan.train_config if plan.train is not None else None


def _step(args: argparse.Namespace, recorded: Any) -> tuple[Any, int | None, list[str]]:
    """(the training step to score, the global batch to split again (None: the step's own split),
    notes): See [Note: the step estimate scores]."""
    flags = with_global_batch(args, train_from_args(args))  # --sync not given: None here
    if recorded is None:  # a baseline, or a plan file without a step: the flags
        return _synced(flags, args.sync), args.global_batch, []
    train = recorded
    if args.precision is not None:
        train = replace(train, param_dtype=flags.param_dtype, reduce_dtype=flags.reduce_dtype,
                        output_dtype=flags.output_dtype)
    if args.optimizer != "adamw":
        train = replace(train, optimizer=flags.optimizer)
    if args.float8 is not None or args.compile is not None:  # the throughput knobs given: they replace the plan's
        train = replace(train, compile=train.compile if args.compile is None else args.compile,
                        float8=flags.float8 if args.float8 else train.float8,
                        float8_all_gather=flags.float8_all_gather if args.float8 else False)
    fixed = args.batch is not None or args.accumulation != 1  # a split of the user's own
    notes = []
    if args.global_batch is not None and (fixed or args.global_batch != recorded.global_batch):
        train = replace(train, micro_batch=flags.micro_batch, grad_accumulation=flags.grad_accumulation,
                        global_batch=None)  # split again (the fastest that fits)
    elif fixed:
        train = replace(train, micro_batch=args.batch or train.micro_batch, grad_accumulation=flags.grad_accumulation,
                        global_batch=None)
    elif args.global_batch is not None:
        notes.append(f"--global-batch {args.global_batch} is the plan's: scored at its own split, micro-batch "
                     f"{recorded.micro_batch} x {recorded.grad_accumulation} accumulation (--batch or --accumulation "
                     "scores another)")
    sync = args.sync if args.sync is not None else recorded.accumulation_sync
    return _synced(train, sync), args.global_batch if train.global_batch is None else None, notes


def _synced(train: Any, sync: str | None) -> Any:
    """``train`` with the gradient sync asked (None: every micro-batch, as a plain FSDP2 loop;
    "auto": the faster that fits). Kept at one micro-batch too: a global batch may split into more."""
    return replace(train, accumulation_sync=None if sync == "auto" else sync or "every")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt estimate`` to the CLI's sub-commands; it runs ``run``."""
    p = subparsers.add_parser("estimate", help="predict step time, throughput, MFU and peak memory of a plan you have")
    add_model_arguments(p)
    p.add_argument("--plan", default="per-block",
                   help=f"a baseline ({', '.join(BASELINE_NAMES)}) or a plan file (plan.json); default per-block")
    add_mesh_arguments(p, world_required=False)
    add_train_arguments(p, sync_default=None, search=False)  # See [Note: the step estimate scores]
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
    add_cp_ep_arguments(p, cp_auto="not here: a degree is chosen by `wrapopt search --cp auto`",
                        ep_auto="not here: estimate the plan file `wrapopt search --ep N --out` writes")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p
