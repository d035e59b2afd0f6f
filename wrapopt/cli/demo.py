"""``wrapopt demo``: the whole job end to end on local gloo ranks."""

from __future__ import annotations

import argparse
from typing import Any

from wrapopt.choices import DEMO_OUT_DIR
from wrapopt.cli.options import add_train_arguments, local_ranks, positive_int, train_from_args

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt demo`` to the CLI's sub-commands; it runs ``run``."""
    p = subparsers.add_parser("demo", help="the whole job end to end on 2 local gloo ranks")
    p.add_argument("--out", default=DEMO_OUT_DIR,
                   help=f"the folder to write (default {DEMO_OUT_DIR}, ignored by git; results/demo/ is the "
                        "recorded run)")
    p.add_argument("--model", default="gpt-tiny", help="a trainable zoo model")
    p.add_argument("--world-size", type=local_ranks, default=2)
    p.add_argument("--repeats", type=positive_int, default=11)
    p.add_argument("--memory", default=None, help="budget (default: midway between the baselines' peaks)")
    add_train_arguments(p)
    p.set_defaults(batch=None, seq=None)
    return p


def run(args: argparse.Namespace) -> int:
    """Body of ``wrapopt demo``: a training step is passed on only when a training flag is given."""
    from wrapopt.evaluation.demo import run_demo

    given = (args.precision is not None or args.accumulation != 1 or args.optimizer != "adamw"
             or args.sync != "auto")
    train = train_from_args(args) if given else None
    return run_demo(out_dir=args.out, model=args.model, world_size=args.world_size, repeats=args.repeats,
                    memory_budget=args.memory, train=train, verbose=args.verbose)
