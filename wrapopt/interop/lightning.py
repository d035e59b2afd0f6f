"""``wrapopt export --to lightning`` (= ``lightning-fsdp2``): ``ModelParallelStrategy`` applying the plan.

The module is exact: its ``configure_model`` calls ``WrapPlan.load(path).apply`` on the
strategy's data-parallel mesh (``interop/lightning_fsdp1.py`` writes the FSDP1 strategy). Plan
strings reach the code through repr or checked identifiers only; see [Note: plan strings in
generated text] in ``interop/common.py``. The module finds the plan file relative to itself (or
at ``$WRAPOPT_PLAN``), defines ``TRAINER_KWARGS`` (nodes, devices, accumulation), and accounts for
every plan field: See [Note: every plan field is written, stated or lost] in wrapopt/interop/fields.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wrapopt.interop.common import Export, classes_for, header, plan_path_code, plan_reference
from wrapopt.interop.fields import Accounting, state_data_and_optimizer, state_float8_compile
from wrapopt.interop.lightning_fsdp1 import trainer_accumulation
from wrapopt.plan.file import WrapPlan

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["export_lightning_fsdp2", "lightning_fsdp2"]

# [Note: the Lightning FSDP2 module]
# ModelParallelStrategy builds a 2-D DeviceMesh ("data_parallel", "tensor_parallel") before it
# calls LightningModule.configure_model, and exposes it there as self.device_mesh. A plan without
# tensor parallelism shards over all ranks, so with tensor_parallel_size=1 the "data_parallel"
# sub-mesh is the plan's 1-D mesh; an HSDP or no-shard plan needs its own 2-D (replicate, shard)
# mesh, which apply builds from the plan on the process group Lightning started (mesh=None). The
# plan's MixedPrecisionPolicy is applied by apply, so the Trainer keeps precision "32-true".
# configure_model may run more than once; the module applies the plan once.
#
# A plan scored with sync last (gradients held unsharded until the last micro-batch of a step) gets
# a ModelParallelStrategy whose block_backward_sync turns FSDP2's gradient sync off on every FSDP
# module: Lightning's Trainer(accumulate_grad_batches=N) runs the first N-1 micro-batches of a step
# under that context, which the base strategy leaves empty for anything but DDP (See [Note:
# Lightning's accumulation under FSDP] in interop/lightning_fsdp1.py).


def export_lightning_fsdp2(plan: WrapPlan, *, model: nn.Module | None, source: str,
                           out: str | None = None) -> Export:
    """The exporter of ``lightning`` and ``lightning-fsdp2``: the model's classes are checked as for
    every target, and the module applies the plan itself."""
    classes_for(plan, model)
    return lightning_fsdp2(plan, source, out)


def lightning_fsdp2(plan: WrapPlan, source: str, out: str | None = None) -> Export:
    """A Python module with ``make_strategy()``, ``TRAINER_KWARGS`` and ``PlannedModule``, whose
    ``configure_model`` applies the plan; see [Note: the Lightning FSDP2 module]."""
    acc = Accounting(plan, "lightning-fsdp2")
    # plan.apply does the wrapping, checkpointing (selective-op too), prefetch, offload and mixed precision
    acc.write("units", "reshard", "checkpoint", "selective_checkpoint", "prefetch", "offload", "mixed_precision",
              "mesh", "hsdp", "multi_node")
    # SyncLastStrategy holds the gradients of a sync-last plan: See [Note: the Lightning FSDP2 module]
    sync_last = plan.accumulation > 1 and plan.train_config.accumulation_sync == "last"
    trainer = {"num_nodes": plan.mesh.num_nodes, "devices": plan.mesh.world_size // plan.mesh.num_nodes,
               **trainer_accumulation(acc, holds_gradients=sync_last)}
    state_float8_compile(acc, applied=True)
    state_data_and_optimizer(acc)
    acc.finish()
    mesh = plan.mesh
    one_axis = mesh.shape == (mesh.world_size,)
    settings: dict[str, Any] = {
        "strategy": "ModelParallelStrategy",
        "data_parallel_size": mesh.world_size,
        "tensor_parallel_size": 1,
        "num_nodes": mesh.num_nodes,
        "devices": mesh.world_size // mesh.num_nodes,
        "mesh": "data_parallel" if one_axis else f"built from the plan {mesh.axis_names} {mesh.shape}",
        "plan": source,
        "trainer": trainer,
        "sync_last_strategy": sync_last,
    }
    mesh_arg = 'self.device_mesh["data_parallel"]' if one_axis else "None"
    mesh_why = ("the strategy's data-parallel mesh is the plan's mesh" if one_axis else
                f"the plan's {mesh.replicate_size} x {mesh.shard_size} (replicate, shard) mesh, built by apply")
    what = "Lightning ModelParallelStrategy (FSDP2): configure_model applies the plan"
    strategy = "SyncLastStrategy" if sync_last else "ModelParallelStrategy"
    text = header(plan, plan_reference(source, out), what, acc.losses, acc.script)
    text += "import contextlib\n" if sync_last else ""
    text += f'''import os

import torch.nn as nn
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy

from wrapopt import WrapPlan

{plan_path_code(source, out)}

NUM_NODES = {mesh.num_nodes!r}
DEVICES_PER_NODE = {settings["devices"]!r}
TRAINER_KWARGS = {trainer!r}  # Trainer(strategy=make_strategy(), **TRAINER_KWARGS, ...)
{_SYNC_LAST_CLASS if sync_last else ""}

def make_strategy() -> ModelParallelStrategy:
    """For Trainer(strategy=make_strategy(), **TRAINER_KWARGS): DEVICES_PER_NODE devices on NUM_NODES nodes.

    Keep the Trainer's precision at "32-true": the plan's mixed precision is applied with it.
    """
    return {strategy}(data_parallel_size={mesh.world_size!r}, tensor_parallel_size=1)


class PlannedModule(LightningModule):
    """Subclass it: set ``self.model`` (the planned model) in ``__init__``; training_step and
    configure_optimizers as usual (build the optimizer from self.parameters() after sharding)."""

    model: nn.Module

    def configure_model(self) -> None:
        if getattr(self, "_plan_applied", False):  # Lightning may call this hook more than once
            return
        # {mesh_why}
        WrapPlan.load(plan_path()).apply(self.model, mesh={mesh_arg})
        self._plan_applied = True
'''
    return Export("lightning-fsdp2", text, settings, tuple(acc.losses), dict(acc.status), tuple(acc.script))


_SYNC_LAST_CLASS = """

class SyncLastStrategy(ModelParallelStrategy):
    \"\"\"The plan's sync last: gradients held unsharded until the last micro-batch of each step;
    Lightning runs every micro-batch of a step but the last under block_backward_sync().\"\"\"

    @contextlib.contextmanager
    def block_backward_sync(self):
        fsdp = [m for m in self.lightning_module.modules() if hasattr(m, "set_requires_gradient_sync")]
        for m in fsdp:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in fsdp:
                m.set_requires_gradient_sync(True, recurse=False)
"""
