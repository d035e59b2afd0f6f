"""``wrapopt bench``: measure wrapopt's plan against the baselines and a plan set, and judge it."""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from wrapopt.choices import PLAN_SET_NAMES
from wrapopt.cli.logs import rank_log_dir
from wrapopt.cli.options import count_int, local_ranks, positive_int
from wrapopt.errors import ModelError
from wrapopt.fileio import atomic_write_json

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt bench`` to the CLI's sub-commands; it runs ``run``."""
    p = subparsers.add_parser("bench", help="measure wrapopt's plan against baselines and an exhaustive plan set")
    p.add_argument("model", help="a trainable zoo model, e.g. zoo:gpt-tiny")
    p.add_argument("--world-size", type=local_ranks, default=2)
    p.add_argument("--ranks-per-node", type=positive_int, default=None)
    p.add_argument("--plans", default="exhaustive", choices=sorted(PLAN_SET_NAMES))
    p.add_argument("--budgets", default="tight,loose", help="comma list: tight, loose, midway or sizes like 12MiB")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--confirm", type=count_int, default=4, metavar="K",
                   help="re-measure the K fastest fitting plans per budget, wrapopt's and the best baseline (0: off)")
    p.add_argument("--confirm-repeats", type=positive_int, default=15)
    p.add_argument("--out", default=None, help="write the raw results (JSON) here")
    return p


def run(args: argparse.Namespace) -> int:
    """Body of ``wrapopt bench``."""
    from wrapopt.evaluation.evaluate import evaluate
    from wrapopt.evaluation.stats import noise_floor
    from wrapopt.evaluation.evidence import format_judgement, judge
    from wrapopt.launch import logs_line

    if not args.model.startswith("zoo:"):
        raise ModelError("wrapopt bench runs real steps of zoo models: give zoo:NAME (see `wrapopt trace --list`)")
    # The ranks' own output goes beside --out, else to a folder in the temporary directory.
    log_dir = rank_log_dir(args, os.path.dirname(os.path.abspath(args.out)) if args.out else
                           os.path.join(tempfile.gettempdir(), "wrapopt-bench"))
    res = evaluate(args.model[4:], world_size=args.world_size, ranks_per_node=args.ranks_per_node,
                   plan_set=args.plans, repeats=args.repeats, budgets=args.budgets.split(","),
                   confirm=args.confirm, confirm_repeats=args.confirm_repeats, log_dir=log_dir)
    verdicts = judge(res, noise_floor(res))
    print(format_judgement(res, verdicts))
    if args.out:
        atomic_write_json(args.out, {"result": res, "verdicts": verdicts})
        print(f"wrote {os.path.abspath(args.out)}")
    if log_dir:
        print(logs_line(log_dir))
    return 0

