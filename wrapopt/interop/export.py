"""``wrapopt export``: a plan in the format a training tool reads (Accelerate, Lightning, plain FSDP1,
TorchTitan).

``export_plan`` refuses a 2-D or 3-D plan (tensor parallelism, pipeline stages) for the targets
that run FSDP alone, naming ``--to torchtitan``, then runs the target's exporter from the one
table of targets, ``EXPORTERS``; see [Note: the exporter table] in ``interop/registry.py``.
Accelerate and Lightning's ``FSDPStrategy`` (FSDP1) wrap by class and list under LOSSES what they do not reproduce;
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
from wrapopt.interop.registry import EXPORTERS, MULTI_D_TARGETS, TARGETS, get_exporter
from wrapopt.plan.file import WrapPlan

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["TARGETS", "EXPORTERS", "ClassPolicy", "Export", "class_policy", "export_plan"]


def export_plan(plan: WrapPlan, *, to: str, model: nn.Module | None = None, source: str = "plan.json",
                out: str | None = None) -> Export:
    """The plan in the format of the target ``to``: an Accelerate config (YAML), a Python module or a TOML file.

    Args:
        to: one of ``TARGETS``: "accelerate", "lightning" (= "lightning-fsdp2": ModelParallelStrategy,
            whose ``configure_model`` applies the plan), "lightning-fsdp1" (FSDPStrategy), "fsdp1"
            (a module whose ``wrap(model)`` applies the plan with FullyShardedDataParallel) or
            "torchtitan" (a TorchTitan job config, the only one for 2-D and 3-D plans).
        model: the planned model, needed only for plan files without module classes.
        source: the plan file's path, quoted in the header and loaded by the Lightning and FSDP1 modules.
        out: the path the export will be written to (None: the current folder); the generated modules
            find the plan file relative to it.

    The result accounts for every field of the plan: ``fields`` says which are written, stated (for the
    training script: ``script``) or lost (``losses``); See [Note: every plan field is written, stated or
    lost] in wrapopt/interop/fields.py.
    """
    exporter = get_exporter(to)
    if to not in MULTI_D_TARGETS:
        _refuse_multi_d(plan, to)
    return exporter(plan, model=model, source=source, out=out)


def _refuse_multi_d(plan: WrapPlan, to: str) -> None:
    """One line for a 2-D or 3-D plan sent to a target that runs FSDP alone, naming the one that carries it."""
    mesh = plan.mesh
    what = ", ".join(x for x in (f"tensor parallelism (degree {mesh.tp_size})" if plan.spec.tp is not None else "",
                                 f"{len(plan.spec.pipeline.stages)} pipeline stages (degree {mesh.pp_size})"
                                 if plan.spec.pipeline is not None else "",
                                 f"context parallelism (degree {mesh.cp_size})" if mesh.cp_size > 1 else "",
                                 f"expert parallelism (degree {mesh.ep_size})" if mesh.ep_size > 1 else "") if x)
    if what:
        dims = f"{1 + sum(d > 1 for d in (mesh.tp_size, mesh.pp_size, mesh.cp_size, mesh.ep_size))}-D"
        raise PlanError(f"this {dims} plan runs {what} under FSDP, which wrapopt cannot export to {to}: export it "
                        "with `--to torchtitan` (a TorchTitan job config), or apply it with plan.apply(model)")
