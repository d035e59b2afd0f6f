"""A model that FSDP2, FSDP1 or tensor parallelism already wrapped is refused by trace,
optimize_wrap and apply in one line saying to pass the unwrapped model (issue 33).
One process: a 1-rank gloo group is enough to wrap a model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.api import optimize_wrap
from wrapopt.errors import ModelError, PlanError
from wrapopt.plan.apply import apply_plan
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec
from wrapopt.trace.meta import trace_model

X = (torch.randn(2, 8),)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


@pytest.fixture(scope="module")
def wrapped() -> dict[str, nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fsdp2 = _mlp()
        fully_shard(fsdp2[0], mesh=init_device_mesh("cpu", (1,)))
        fully_shard(fsdp2, mesh=init_device_mesh("cpu", (1,)))
        yield {"fsdp2": fsdp2, "fsdp1": FullyShardedDataParallel(_mlp(), device_id=torch.device("cpu"))}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind, words", [("fsdp2", "already sharded (fully_shard was applied to <root>, 0"),
                                         ("fsdp1", "already wrapped by FSDP1 (FullyShardedDataParallel at <root>")])
def test_trace_optimize_wrap_and_apply_refuse_a_wrapped_model(wrapped, kind, words):
    model = wrapped[kind]
    spec = PlanSpec((UnitSpec((ROOT,), False),), MeshSpec(world_size=1, ranks_per_node=1, shard_size=1))
    calls = {"trace": lambda: trace_model(model, X), "trace ": lambda: optimize_wrap(model, X, world_size=1),
             "apply": lambda: apply_plan(model, spec)}
    for stage, call in calls.items():
        with pytest.raises(ModelError if stage != "apply" else PlanError) as err:
            call()
        msg = str(err.value)
        assert msg.startswith(stage.strip() + ":") and words in msg and "pass the unwrapped model" in msg, msg
        assert "\n" not in msg
