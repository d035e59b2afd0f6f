"""Flags shared by ``wrapopt search`` and ``wrapopt estimate``: the mesh, the fabric, the budget
and the training step (``--precision``, ``--accumulation``, ``--optimizer``, ``--sync``).

The ``add_*`` and ``type=`` functions need no torch; the ``*_from_args`` builders import the
library when a command runs (See [Note: first contact] in wrapopt/cli/main.py)."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from wrapopt.checks import MAX_SEED
from wrapopt.choices import OPTIMIZERS, PRECISIONS
from wrapopt.errors import OptionError
from wrapopt.fileio import parse_bytes
from wrapopt.spec import FLOAT8_RECIPES, SYNC_MODES

if TYPE_CHECKING:
    from wrapopt.hardware.host import HostSpec
    from wrapopt.hardware.profiles import FabricProfile
    from wrapopt.models.sources import ModelSource
    from wrapopt.spec import MeshSpec
    from wrapopt.train import TrainConfig

__all__ = ["add_mesh_arguments", "add_offload_arguments", "host_from_args",
           "add_train_arguments", "train_from_args", "mesh_from_args",
           "add_model_arguments", "positive_int", "count_int", "positive_float", "tp_degree", "seed_int",
           "local_ranks", "with_global_batch", "fabric_from_args", "add_pp_argument", "add_cp_ep_arguments",
           "sync_note"]


# argparse ``type=`` functions: argparse prefixes their message with "argument --name: ", so every
# refusal names the option (See [Note: numbers where they enter] in wrapopt/checks.py).
def positive_int(text: str) -> int:
    """An integer of at least 1 (ranks, batch, sequence length, repeats, ...)."""
    return _int(text, minimum=1)


def local_ranks(text: str) -> int:
    """Local ranks to spawn: an integer of at least 2 (a group of one has no collective to time)."""
    return _int(text, minimum=2)


def count_int(text: str) -> int:
    """An integer of at least 0, where 0 means none (trials, warm-up calls, confirmations)."""
    return _int(text, minimum=0)


def _int(text: str, *, minimum: int) -> int:
    what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def seed_int(text: str) -> int:
    """A sampler seed: an integer from 0 to 2**32 - 1 (numpy's range, which Optuna seeds)."""
    value = count_int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {MAX_SEED}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


def tp_degree(text: str) -> str:
    """``auto`` or a positive integer (the tensor-parallel degree)."""
    if text == "auto":
        return text
    try:
        return str(positive_int(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or a positive integer, got {text!r}") from None


def add_pp_argument(p: argparse.ArgumentParser, *, what: str) -> None:
    """``--pp auto|N``: the pipeline degree (See [Note: pipeline search] in wrapopt/search/pipeline.py)."""
    p.add_argument("--pp", type=tp_degree, default="1", metavar="auto|1|2|4|8",
                   help=f"pipeline-parallel degree (stages across ranks, outermost): {what} (default 1: none)")


def add_cp_ep_arguments(p: argparse.ArgumentParser, *, cp_auto: str, ep_auto: str) -> None:
    """``--cp auto|N`` and ``--ep auto|N``: the context- and expert-parallel degrees (See [Note:
    the cp and ep axes of the mesh] in wrapopt/spec/plan.py); ``cp_auto``/``ep_auto`` say what auto does."""
    p.add_argument("--cp", type=tp_degree, default="1", metavar="auto|1|2|4|8",
                   help="context-parallel degree: each sequence split over N ranks (ring attention with the "
                        "head-tail load balancer, FSDP over dp_shard x cp as TorchTitan); "
                        f"auto: {cp_auto} (default 1: none)")
    p.add_argument("--ep", type=tp_degree, default="1", metavar="auto|1|2|4|8",
                   help="expert-parallel degree: a mixture of experts' experts split over N ranks, tokens sent by "
                        f"all-to-all (TorchTitan's efsdp x ep); auto: {ep_auto} (default 1: none)")


def add_model_arguments(p: argparse.ArgumentParser, *, optional: bool = False) -> None:
    """MODEL, ``--batch`` and ``--seq``; ``optional``: MODEL may be left out (``wrapopt trace --list``)."""
    p.add_argument("model", nargs="?" if optional else None,
                   help="zoo:NAME (`wrapopt trace --list`), package.module:callable, or hf:path/to/config.json")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="per-rank batch of one micro-batch, for the example inputs")
    p.add_argument("--seq", type=_seq, default=None,
                   help="sequence length (token models; audio models: encoder frames), at most the model's positions "
                        "(`wrapopt trace` shows them); context: the hf: config's own context length")
    p.add_argument("--master-dtype", default=None, choices=("float32", "bfloat16"),
                   help="dtype of the master weights, gradients and optimizer state: float32 (default: hf: and zoo: "
                        "models are built in it; with --precision bf16 that is FSDP2's, TorchTitan's and "
                        "Accelerate's mixed precision), or bfloat16 for pure bf16 training (the model cast with "
                        "model.to(torch.bfloat16) before sharding: half the static memory, bf16 optimizer updates)")


def model_from_args(args: argparse.Namespace) -> ModelSource:
    """The ``ModelSource`` of MODEL, ``--batch``, ``--seq`` and ``--master-dtype``."""
    from wrapopt.models.sources import resolve_model, with_master_dtype

    src = resolve_model(args.model, batch=args.batch, seq=args.seq)
    return with_master_dtype(src, args.master_dtype)


def _seq(text: str) -> int | str:
    """``--seq``: a positive integer, or ``context`` (the model's own positions)."""
    if text.strip().lower() == "context":
        return "context"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or `context`, got {text!r}") from None


def add_mesh_arguments(p: argparse.ArgumentParser, *, world_required: bool = True) -> None:
    p.add_argument("--world-size", type=positive_int, required=world_required, default=None)
    p.add_argument("--gpus-per-node", type=positive_int, default=None, help="ranks per node (default: min(world, 8))")
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
                   help="per-rank budget: bytes, 80GiB, 80GB, 80G (= 80GiB), auto or none (default auto: 90%% of "
                        "the device's capacity when it is known; none: no limit)")
    p.add_argument("--rescale-fabric", action="store_true", help="allow a measured profile from another mesh, rescaled")


def add_offload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offload", action="store_true",
                   help="search CPU offload too (FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer state in "
                        "host memory, the optimizer on the CPU), chosen only where it is the fastest plan that fits; "
                        "needs --host-memory and a stated GPU (--gpu)")
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="host memory the job may fill per node, for --offload (e.g. 1.5TB)")


def host_from_args(args: argparse.Namespace, fabric: FabricProfile, mesh: MeshSpec) -> HostSpec | None:
    """The host ``--offload`` offloads to (None without --offload); --host-memory alone is refused, as is
    --offload without it."""
    if not getattr(args, "offload", False):
        if getattr(args, "host_memory", None):
            raise OptionError("--host-memory is only read with --offload; add --offload to search CPU offload")
        return None
    from wrapopt.hardware.host import host_for

    size = parse_bytes(args.host_memory) if args.host_memory else None
    return host_for(fabric, host_memory_bytes=size, ranks_per_node=mesh.ranks_per_node)


def fabric_from_args(args: argparse.Namespace) -> str | None:
    """``--fabric``, or the ``GPU+NETWORK`` fabric that ``--gpu`` and ``--network`` name."""
    from wrapopt.hardware.resolve import fabric_name

    return fabric_name(fabric=args.fabric, gpu=args.gpu, network=args.network)


def add_train_arguments(p: argparse.ArgumentParser, *, sync_default: str | None = "auto", search: bool = True) -> None:
    """``--precision``, ``--accumulation``, ``--global-batch``, ``--optimizer``, ``--sync`` and the
    throughput knobs (``sync_default`` None: a command that scores a job as it runs, every
    micro-batch unless told; ``search`` False: one that scores a step, without ``--float8 auto``)."""
    p.add_argument("--precision", default=None, metavar="{none," + ",".join(PRECISIONS) + "}",
                   help="mixed precision: bf16 = bf16 gathered parameters and compute, fp32 gradient reduction, "
                        "fp32 master weights and optimizer state (FSDP2's MixedPrecisionPolicy); bf16-pure reduces "
                        "in bf16 too; fp16; fp32 computes in float32; none (default): no policy, the model's own "
                        "dtype (hf: models are built in float32 whatever their config's torch_dtype)")
    p.add_argument("--accumulation", type=positive_int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--global-batch", type=positive_int, default=None, metavar="N",
                   help="sequences per optimizer step over all data-parallel ranks, fixed: the micro-batch per rank "
                        "and the accumulation are chosen (with --batch: that micro-batch; with --accumulation K > 1: "
                        "that accumulation); with --pp, each pipeline's micro-batch count and size; with --seq, N x "
                        "seq tokens")
    p.add_argument("--optimizer", default="adamw", metavar="{" + ",".join(OPTIMIZERS) + "}",
                   help="the optimizer, for its state and step time (default adamw)")
    default = ("auto (default): the faster that fits, per plan" if sync_default == "auto" else
               "auto: the faster that fits; default: the plan file's, else every (a plain FSDP2 loop)")
    p.add_argument("--sync", default=sync_default, metavar="{auto," + ",".join(SYNC_MODES) + "}",
                   help="with --accumulation > 1: reduce-scatter after every micro-batch, or after the last only "
                        f"(no-sync: holds unsharded gradients); {default}")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="each block compiled with torch.compile(fullgraph=True) after fully_shard, as TorchTitan "
                        "does: the memory-bound ops fused (See [Note: compile costs]); default: on for a stated GPU "
                        "(--gpu, an analytical profile), off for a measured profile; --no-compile: eager")
    searched = ", auto (searched: none, tensorwise, tensorwise with the float8 all-gather, rowwise)" if search else ""
    p.add_argument("--float8", default=None, choices=(*FLOAT8_RECIPES, *(("auto",) if search else ())),
                   help="torchao float8 training of the eligible linears (TorchTitan's filter): none, tensorwise or "
                        f"rowwise scaling{searched}; needs FP8 tensor cores (H100, H200); default none (it changes "
                        "numerics: opt in, as in TorchTitan)")
    p.add_argument("--float8-all-gather", action="store_true", default=False,
                   help="with --float8 tensorwise: FSDP2 all-gathers the float8 weights (1 byte per parameter plus "
                        "a scale)")


def sync_note(sync: str | None, accumulation: int, *, pipeline: bool = False) -> list[str]:
    """A note when ``--sync every|last`` was given but the step has one micro-batch (nothing to
    sync differently: the flag changes nothing), else none. A pipeline's micro-batches are its own."""
    if sync in (None, "auto") or accumulation > 1 or pipeline:
        return []
    return [f"--sync {sync} changes nothing here: the step has one micro-batch (no accumulation); give "
            "--accumulation K or a --global-batch with more micro-batches"]


def train_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of the flags; a bad value raises ValueError naming what is accepted."""
    from wrapopt.train import TrainConfig

    return TrainConfig.parse(precision=args.precision, accumulation=args.accumulation, optimizer=args.optimizer,
                             sync=args.sync, compile=getattr(args, "compile", None),
                             float8=getattr(args, "float8", None),
                             float8_all_gather=getattr(args, "float8_all_gather", False))


def mesh_from_args(args: argparse.Namespace) -> MeshSpec:
    """The mesh of ``--world-size`` and ``--gpus-per-node`` (defaults: ``api.default_mesh``);
    a world that is not whole nodes raises ValueError (``positive_int`` refused sizes below 1)."""
    from wrapopt.api import default_mesh
    from wrapopt.hardware.resolve import partial_node_note

    world = args.world_size
    if world is not None:
        per_node = min(world, 8) if args.gpus_per_node is None else args.gpus_per_node
        if world > per_node and world % per_node:
            raise ValueError(f"--world-size {world} is not a multiple of --gpus-per-node {per_node}")
    note = partial_node_note(world, args.gpus_per_node)
    if note and not getattr(args, "partial_node_noted", False):  # once, however often the mesh is read
        print(f"note: {note}", file=sys.stderr)
        args.partial_node_noted = True
    return default_mesh(world_size=world, gpus_per_node=args.gpus_per_node)


def with_global_batch(args: argparse.Namespace, train: TrainConfig) -> TrainConfig:
    """``train`` with ``--batch`` as its micro-batch when ``--global-batch`` fixes the global batch
    (the search then chooses the accumulation alone); a global batch below 1 raises ValueError."""
    if args.global_batch is None:
        return train
    if args.global_batch < 1:
        raise ValueError(f"--global-batch must be at least 1 (sequences per optimizer step), got {args.global_batch}")
    return replace(train, micro_batch=args.batch) if args.batch is not None else train
