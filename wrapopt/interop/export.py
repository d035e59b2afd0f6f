"""``wrapopt export``: a plan in the format a training tool reads (Accelerate, Lightning, plain FSDP1).

``export_plan`` refuses what no target can express (pipeline stages, tensor parallelism),
then runs the target's exporter from the one table of targets, ``EXPORTERS``; see
[Note: the exporter table] in ``interop/registry.py``. Accelerate and Lightning's
``FSDPStrategy`` (FSDP1) wrap by class and list under LOSSES what they do not reproduce;
Lightning's ``ModelParallelStrategy`` (FSDP2) runs the plan itself, and the ``fsdp1`` module wraps
the plan's own units with FSDP1.

Example:
    >>> from wrapopt.interop import export_plan
    >>> out = export_plan(WrapPlan.load("plan.json"), to="accelerate")  # doctest: +SKIP
    >>> print(out.text); print(out.losses)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wrapopt.errors import PlanError
from wrapopt.interop.common import ClassPolicy, Export
from wrapopt.interop.policy import class_policy
from wrapopt.interop.registry import EXPORTERS, TARGETS, get_exporter
from wrapopt.plan.file import WrapPlan

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["TARGETS", "EXPORTERS", "ClassPolicy", "Export", "class_policy", "export_plan"]


def export_plan(plan: WrapPlan, *, to: str, model: nn.Module | None = None, source: str = "plan.json") -> Export:
    """The plan in the format of the target ``to``: an Accelerate config (YAML) or a Python module.

    Args:
        to: one of ``TARGETS``: "accelerate", "lightning" (= "lightning-fsdp2": ModelParallelStrategy,
            whose ``configure_model`` applies the plan), "lightning-fsdp1" (FSDPStrategy) or "fsdp1"
            (a module whose ``wrap(model)`` applies the plan with FullyShardedDataParallel).
        model: the planned model, needed only for plan files without module classes.
        source: the plan file's path, quoted in the header and loaded by the Lightning module.
    """
    exporter = get_exporter(to)
    if plan.spec.pipeline is not None:
        raise PlanError(f"this plan runs {len(plan.spec.pipeline.stages)} pipeline stages, which wrapopt cannot "
                        f"export to {to}: apply it with plan.apply(model) (FSDP2 + torch.distributed.pipelining)")
    if plan.spec.tp is not None:
        raise PlanError(f"this plan runs tensor parallelism (degree {plan.mesh.tp_size}) under FSDP, which wrapopt "
                        f"cannot export to {to}: apply it with plan.apply(model) (FSDP2)")
    return exporter(plan, model=model, source=source)
