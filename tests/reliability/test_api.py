"""Misuse of the Python API: each call raises a ``WrapoptError`` whose message is one line
naming the argument and what it accepts; nothing is replaced by a default (``world_size=0``
is not 8) and nothing cut back (issue 33). Single process: the wrapped-model case uses a
1-rank gloo group in this process, as tests/test_wrapped.py does."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.reliability.common import assert_api_refuses, case
from wrapopt.api import default_mesh, estimate, optimize_wrap
from wrapopt.errors import ModelError, OptionError
from wrapopt.hardware.presets import analytical_fabric
from wrapopt.models import zoo
from wrapopt.models.sources import resolve_model
from wrapopt.spec import MeshSpec
from wrapopt.train import TrainConfig

GPT, X = zoo.build("gpt-tiny", "meta")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def per_example_loss(output, inputs):
    return output.pow(2).mean(dim=-1)  # not reduced over the batch: shape (batch,)


def _plan(**kw):
    return lambda: optimize_wrap(GPT, X, **kw)


def _estimate(**kw):
    return lambda: estimate(GPT, X, **kw)


CALLS = [
    case(_plan(world_size=0), OptionError, "world_size", "positive integer", "got 0", id="optimize-world-0"),
    case(_plan(world_size=-4), OptionError, "world_size", id="optimize-world-negative"),
    case(_plan(world_size=2.5), OptionError, "world_size", "got 2.5", id="optimize-world-fraction"),
    case(_plan(world_size=True), OptionError, "world_size", id="optimize-world-bool"),
    case(_plan(gpus_per_node=0), OptionError, "gpus_per_node", "got 0", id="optimize-gpus-per-node-0"),
    case(_plan(world_size=8, seed=-1), OptionError, "seed", id="optimize-seed-negative"),
    case(_plan(world_size=8, seed=2**40), OptionError, "seed", "4294967295", id="optimize-seed-past-numpy"),
    case(_plan(world_size=8, trials=-1), OptionError, "trials", "at least 0", "got -1", id="optimize-trials-negative"),
    case(_plan(world_size=8, trials=2.5), OptionError, "trials", id="optimize-trials-fraction"),
    case(_plan(world_size=8, memory_budget=math.nan), OptionError, "memory_budget", "nan", id="optimize-budget-nan"),
    case(_plan(world_size=8, memory_budget=math.inf), OptionError, "memory_budget", id="optimize-budget-inf"),
    case(_plan(world_size=8, memory_budget=-1), OptionError, "memory_budget", id="optimize-budget-negative"),
    case(_plan(world_size=8, memory_budget=0), OptionError, "memory_budget", id="optimize-budget-0"),
    case(_plan(world_size=8, memory_budget="80XB"), OptionError, "memory_budget", "80GiB", id="optimize-budget-unit"),
    case(_plan(world_size=8, tp=0), OptionError, "--tp", "positive integer", id="optimize-tp-0"),
    case(_plan(world_size=8, tp=2.5), OptionError, "--tp", "2.5", id="optimize-tp-fraction"),
    case(_plan(world_size=8, tp=3), OptionError, "--tp 3", id="optimize-tp-not-divisor"),
    case(lambda: optimize_wrap(_mlp(), (torch.randn(3, 4),), world_size=2, loss_fn=per_example_loss), ModelError,
         "per_example_loss", "(3,)", id="optimize-loss-not-scalar"),
    case(_estimate(world_size=0), OptionError, "world_size", id="estimate-world-0"),
    case(_estimate(gpus_per_node=-1), OptionError, "gpus_per_node", id="estimate-gpus-per-node-negative"),
    case(_estimate(plan="fastest"), OptionError, "--plan", "per-block", id="estimate-unknown-plan"),
    case(_estimate(checkpoint="all"), OptionError, "--checkpoint", id="estimate-unknown-checkpoint"),
    case(_estimate(memory_budget=math.nan), OptionError, "memory_budget", id="estimate-budget-nan"),
    case(lambda: default_mesh(world_size=0, gpus_per_node=None), OptionError, "world_size", id="default-mesh-0"),
    case(lambda: MeshSpec(world_size=0, ranks_per_node=1, shard_size=1), OptionError, "MeshSpec.world_size",
         id="mesh-world-0"),
    case(lambda: MeshSpec(world_size=8, ranks_per_node=8, shard_size=8, tp_size=0), OptionError, "MeshSpec.tp_size",
         id="mesh-tp-0"),
    case(lambda: MeshSpec(world_size=8.0, ranks_per_node=8, shard_size=8), OptionError, "MeshSpec.world_size",
         "got 8.0", id="mesh-world-float"),
    case(lambda: MeshSpec(world_size=8, ranks_per_node=3, shard_size=8), OptionError, "ranks per node",
         id="mesh-not-whole-nodes"),
    case(lambda: analytical_fabric(world_size=8, ranks_per_node=0), OptionError, "ranks_per_node",
         id="analytical-fabric-ranks-0"),
    case(lambda: TrainConfig(grad_accumulation=0), OptionError, "grad_accumulation", id="train-accumulation-0"),
    case(lambda: TrainConfig(optimizer="adamx"), OptionError, "adamx", "adamw", id="train-unknown-optimizer"),
    case(lambda: TrainConfig.parse(precision="bf32"), OptionError, "bf32", id="train-unknown-precision"),
    case(lambda: resolve_model("zoo:gpt-tiny", batch=0), OptionError, "--batch", "got 0", id="source-batch-0"),
    case(lambda: resolve_model("zoo:llama-7b", seq=8192), OptionError, "limit of 4096", id="source-seq-past-limit"),
    case(lambda: zoo.get_entry("gpt-tiny").inputs(batch=0), OptionError, "batch", id="zoo-inputs-batch-0"),
]


@pytest.mark.parametrize("call, error, fragments", CALLS)
def test_api_misuse(call, error, fragments):
    assert_api_refuses(call, error, fragments)


def test_default_mesh_keeps_what_is_given():
    """A size given is used as given; only an absent one takes the default."""
    assert default_mesh(world_size=None, gpus_per_node=None) == MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
    assert default_mesh(world_size=2, gpus_per_node=None).ranks_per_node == 2
    assert default_mesh(world_size=16, gpus_per_node=4).ranks_per_node == 4


def test_a_wrapped_model_is_refused():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _mlp()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert_api_refuses(lambda: optimize_wrap(model, (torch.randn(2, 4),), world_size=1), ModelError,
                           ("already sharded", "pass the unwrapped model"))
    finally:
        dist.destroy_process_group()
