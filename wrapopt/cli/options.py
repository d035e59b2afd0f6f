"""Flags shared by ``wrapopt search`` and ``wrapopt estimate``: the mesh, the fabric, the budget
and the training step (``--precision``, ``--accumulation``, ``--optimizer``, ``--sync``)."""

from __future__ import annotations

import argparse

from wrapopt.api import default_mesh
from wrapopt.hardware.resolve import fabric_name
from wrapopt.spec import MeshSpec
from wrapopt.train import OPTIMIZERS, PRECISIONS, SYNC_MODES, TrainConfig

__all__ = ["add_mesh_arguments", "add_train_arguments", "train_from_args", "mesh_from_args",
           "add_model_arguments", "check_batch",
           "fabric_from_args"]


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="zoo:NAME, package.module:callable, or hf:path/to/config.json")
    p.add_argument("--batch", type=int, default=None, help="per-rank batch of one micro-batch, for the example inputs")
    p.add_argument("--seq", type=int, default=None, help="sequence length (token models)")


def add_mesh_arguments(p: argparse.ArgumentParser, *, world_required: bool = True) -> None:
    p.add_argument("--world-size", type=int, required=world_required, default=None)
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (default: min(world, 8))")
    p.add_argument("--fabric", default=None,
                   help="a measured fabric profile (JSON), a file of stated numbers (`wrapopt fabric --template`), "
                        "or a built-in analytical fabric (`wrapopt fabric --list`; default h100-nvlink-ib400)")
    p.add_argument("--gpu", default=None,
                   help="a GPU preset (a100-40gb-sxm, a100-80gb-sxm, h100-sxm, h100-nvl, h200; `wrapopt fabric "
                        "--list`) or a file of stated numbers (`wrapopt fabric --template-gpu`); instead of --fabric")
    p.add_argument("--network", default=None,
                   help="a network preset: between nodes ib800, ib400, ib200, ib100, roce400, roce200, eth100 (inside: "
                        "the GPU's NVLink), or INSIDE-BETWEEN (nvlink4-ib400, pcie5-roce200), or a file of stated "
                        "numbers (`wrapopt fabric --template-network`)")
    p.add_argument("--compute", default=None, help="compute profile JSON (default: the fabric's stated device, "
                                                   "computing in the --precision dtype)")
    p.add_argument("--memory", default=None,
                   help="per-rank budget: bytes, 80GiB, 80GB, auto or none (default auto: 90%% of the device's "
                        "capacity when it is known; none: no limit)")
    p.add_argument("--rescale-fabric", action="store_true", help="allow a measured profile from another mesh, rescaled")


def fabric_from_args(args: argparse.Namespace) -> str | None:
    """``--fabric``, or the ``GPU+NETWORK`` fabric that ``--gpu`` and ``--network`` name."""
    return fabric_name(fabric=args.fabric, gpu=args.gpu, network=args.network)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", default=None, metavar="{none," + ",".join(PRECISIONS) + "}",
                   help="mixed precision: bf16 = bf16 parameters and compute, fp32 gradient reduction; bf16-pure "
                        "reduces in bf16 too; fp16; fp32 computes in float32; none (default): no policy, the "
                        "model's own dtype")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--optimizer", default="adamw", metavar="{" + ",".join(OPTIMIZERS) + "}",
                   help="the optimizer, for its state and step time (default adamw)")
    p.add_argument("--sync", default="auto", metavar="{auto," + ",".join(SYNC_MODES) + "}",
                   help="with --accumulation > 1: reduce-scatter after every micro-batch, or after the last only "
                        "(no-sync: holds unsharded gradients); auto (default): the faster that fits, per plan")


def train_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of the flags; a bad value raises ValueError naming what is accepted."""
    if args.accumulation < 1:
        raise ValueError(f"--accumulation must be at least 1, got {args.accumulation}")
    check_batch(args)
    return TrainConfig.parse(precision=args.precision, accumulation=args.accumulation, optimizer=args.optimizer,
                             sync=args.sync)


def check_batch(args: argparse.Namespace) -> None:
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch must be at least 1, got {args.batch}")
    if args.seq is not None and args.seq < 1:
        raise ValueError(f"--seq must be at least 1, got {args.seq}")


def mesh_from_args(args: argparse.Namespace) -> MeshSpec:
    """The mesh of ``--world-size`` and ``--gpus-per-node`` (defaults: ``api.default_mesh``);
    a world that is not positive, or not whole nodes, raises ValueError."""
    world = args.world_size
    if world is not None:
        if world < 1:
            raise ValueError(f"--world-size must be positive, got {world}")
        per_node = args.gpus_per_node or min(world, 8)
        if world > per_node and world % per_node:
            raise ValueError(f"--world-size {world} is not a multiple of --gpus-per-node {per_node}")
    return default_mesh(world_size=world, gpus_per_node=args.gpus_per_node)
