"""The export targets, in one table: ``wrapopt export --to`` offers them and ``export_plan`` runs them.

[Note: the exporter table]
Each target is an ``Exporter``: its name, the one line ``wrapopt export --help`` shows, and
the function that writes it, named as ``"module:function"``. The function is imported only
when the target is used, so the table (and the CLI's help and choices, built from it) loads
no torch; See [Note: first contact] in wrapopt/cli/main.py. Every function takes
``(plan, *, model, source, out)`` and returns an ``Export`` that accounts for every plan field
(See [Note: every plan field is written, stated or lost] in wrapopt/interop/fields.py);
``export_plan`` refuses a 2-D or 3-D plan (tensor parallelism, pipeline stages) for every target
but those in ``MULTI_D_TARGETS``.

A new target is a module under ``wrapopt/interop/`` with one such function, and one row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from wrapopt.interop.common import Export

__all__ = ["Exporter", "EXPORTERS", "MULTI_D_TARGETS", "TARGETS", "get_exporter", "targets_help"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Exporter:
    """One export target: ``wrapopt export --to NAME``, ``export_plan(plan, to=NAME)``."""

    name: str
    help: str  # one line, for `wrapopt export --help`
    function: str  # "module:function", imported on first use (the table loads no torch)

    def load(self) -> Callable[..., Export]:
        """The exporter function: ``(plan, *, model, source, out) -> Export``."""
        module, _, attr = self.function.partition(":")
        return getattr(importlib.import_module(module), attr)

    def __call__(self, plan: Any, *, model: Any = None, source: str = "plan.json", out: str | None = None) -> Export:
        return self.load()(plan, model=model, source=source, out=out)


_FSDP2 = "wrapopt.interop.lightning:export_lightning_fsdp2"

EXPORTERS: dict[str, Exporter] = {e.name: e for e in (
    Exporter(name="accelerate", function="wrapopt.interop.accelerate:export_accelerate",
             help="a config for `accelerate launch --config_file` (FSDP2, wraps the block class)"),
    Exporter(name="lightning", function=_FSDP2, help="the same as lightning-fsdp2"),
    Exporter(name="lightning-fsdp2", function=_FSDP2,
             help="a module with ModelParallelStrategy whose configure_model applies the plan (FSDP2, exact)"),
    Exporter(name="lightning-fsdp1", function="wrapopt.interop.lightning_fsdp1:export_lightning_fsdp1",
             help="an FSDPStrategy (FSDP1) wrapping the closest classes"),
    Exporter(name="fsdp1", function="wrapopt.interop.fsdp1:export_fsdp1",
             help="a module whose wrap(model) applies the plan with FullyShardedDataParallel (FSDP1, one unit "
                  "per planned module)"),
    Exporter(name="torchtitan", function="wrapopt.interop.torchtitan:export_torchtitan",
             help="a TorchTitan job config (TOML, torchtitan 0.2.x --job.config_file): the 1-D, 2-D or 3-D "
                  "degrees, pipeline schedule, checkpointing and batch sizes"),
)}

TARGETS = tuple(EXPORTERS)  # the names, in the order --help lists them
MULTI_D_TARGETS = ("torchtitan",)  # the targets that carry tensor and pipeline parallelism


def get_exporter(name: str) -> Exporter:
    """The target named ``name``; a ValueError lists the targets otherwise."""
    if name not in EXPORTERS:
        raise ValueError(f"cannot export to {name!r}; choose one of: {', '.join(TARGETS)}")
    return EXPORTERS[name]


def targets_help() -> str:
    """``NAME: help; NAME: help; ...``, for the ``--to`` option's help."""
    return "; ".join(f"{e.name}: {e.help}" for e in EXPORTERS.values())
