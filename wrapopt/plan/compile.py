"""torch.compile per block, as TorchTitan applies it.

[Note: compiling per block]
TorchTitan compiles each transformer block with ``fullgraph=True``
(torchtitan/distributed/compile.py ``apply_compile``): the blocks repeat, so one compiled graph
serves them all. ``compile_blocks`` does the same for the modules of a plan's units (each module
of a non-root unit: the blocks of a per-block plan), after ``fully_shard``. It compiles the
block's ``forward``, not its whole call (``nn.Module.compile``): the hooks stay eager around it,
FSDP2's (as in TorchTitan, where dynamo skips them: ``torch._dynamo.config.skip_fsdp_hooks``)
and the composable ``checkpoint``'s, whose context manager dynamo cannot return from a graph
(TorchTitan wraps its blocks in a checkpoint module instead, which its compile takes in); so a
checkpointed unit compiles whole, its recomputation running the compiled forward.

``fullgraph=True`` refuses a graph break, but only when the block first runs: dynamo traces at
the first call. So each block's compiled forward is wrapped: a graph break there
(``torch._dynamo.exc.Unsupported``: a data-dependent branch, a ``print``, an untraceable call)
is caught before anything of the block has run (dynamo traces before it executes), the block
goes back to its eager forward for good, a warning line names the module and the break, and
``compile_report(model)`` records it (``{"compiled": [...], "eager": {module: break}}``).
A failure that is not a graph break (inductor's own) is raised as it is.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch.nn as nn

__all__ = ["compile_blocks", "compile_report"]

_REPORT = "_wrapopt_compile"


def compile_report(model: nn.Module) -> dict[str, Any] | None:
    """What ``compile_blocks`` did to ``model``: ``{"compiled": [names], "eager": {name: the graph break}}``;
    a block is moved from compiled to eager when its first call breaks the graph. None: not compiled."""
    return getattr(model, _REPORT, None)


def compile_blocks(model: nn.Module, names: Iterable[str], *, backend: str = "inductor") -> dict[str, Any]:
    """``torch.compile(module.forward, fullgraph=True)`` for each named module of ``model``; a module
    whose graph breaks runs eager, saying so. See [Note: compiling per block]."""
    import torch

    modules = dict(model.named_modules())
    report: dict[str, Any] = {"compiled": [], "eager": {}, "backend": backend}
    object.__setattr__(model, _REPORT, report)
    for name in names:
        block = modules[name]
        eager = block.forward
        compiled = torch.compile(eager, backend=backend, fullgraph=True)
        block.forward = _guarded(block, name or "<root>", eager, compiled, report)
        report["compiled"].append(name or "<root>")
    return report


def _guarded(block: nn.Module, name: str, eager: Any, compiled: Any, report: dict[str, Any]):
    from torch._dynamo.exc import Unsupported

    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except Unsupported as e:
            why = _first_line(e)
            block.forward = eager  # eager from now on
            if name in report["compiled"]:
                report["compiled"].remove(name)
            report["eager"][name] = why
            warnings.warn(f"wrapopt: {name} ({type(block).__name__}) cannot be compiled whole (fullgraph): {why}; "
                          "it runs eager", stacklevel=2)
            return eager(*args, **kwargs)

    return forward


def _first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    text = " ".join(lines[:2]) if lines else type(e).__name__
    return text[:200]
