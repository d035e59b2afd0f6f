"""Second-tier memory check: PyTorch's own FSDPMemTracker on fake tensors.

``fake_peak_bytes`` runs the real ``fully_shard`` code for a plan, in one
process, on a *fake* process group of the plan's world size and under
``FakeTensorMode`` (no memory is allocated, so a 7B model is checked on a
laptop), for two training steps, and returns the peak that
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` records for the
second. It follows FSDP2's GPU code path (synchronous all-gathers, the
deferred all-gather buffer), so it checks predictions made for GPUs.

It needs the fake backend as the default process group; ``run_fake_check``
starts a fresh interpreter for that, so it can be called from anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from wrapopt.errors import WrapoptError
from wrapopt.models import zoo
from wrapopt.plan.apply import apply_plan, build_mesh
from wrapopt.plan.file import WrapPlan

__all__ = ["fake_peak_bytes", "run_fake_check"]


def fake_peak_bytes(zoo_name: str, plan_json: dict[str, Any], *, seq: int | None = None) -> dict[str, float]:
    """FSDPMemTracker's peak (bytes, by category) for one plan of a zoo model; needs a fake process group."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    assert dist.is_initialized() and dist.get_backend() == "fake", "call under a fake process group (run_fake_check)"
    entry = zoo.get_entry(zoo_name)
    inputs = entry.inputs()
    if seq is not None:
        inputs = tuple(t[:, :seq] for t in inputs)
    plan = WrapPlan.from_json(plan_json)
    mesh = build_mesh(plan.spec)  # outside fake mode: the mesh needs real tensors
    with FakeTensorMode(allow_non_fake_inputs=True):
        dtype = torch.float32 if entry.trainable else torch.bfloat16
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = entry.factory()
        finally:
            torch.set_default_dtype(old)
        apply_plan(model, plan.spec, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs(inputs)
        with tracker:
            for step in range(2):
                loss = entry.loss(model(*inputs), inputs)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()
        snap = tracker.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    return {str(getattr(k, "value", k)): float(v) for k, v in snap[dev].items()}


def _main() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    args = json.loads(sys.stdin.read())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args["world_size"])
    out = [fake_peak_bytes(args["model"], p, seq=args.get("seq")) for p in args["plans"]]
    dist.destroy_process_group()
    print(json.dumps(out))


def run_fake_check(zoo_name: str, plans: list[dict[str, Any]], *, world_size: int, seq: int | None = None,
                   timeout_s: float = 900.0) -> list[dict[str, float]]:
    """``fake_peak_bytes`` for each plan (plan-file JSON) in a fresh interpreter; one dict per plan."""
    payload = json.dumps({"model": zoo_name, "plans": plans, "world_size": world_size, "seq": seq})
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", _main.__module__], input=payload, capture_output=True,
                          text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode
        raise WrapoptError(f"FSDPMemTracker check failed: {why}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    _main()
