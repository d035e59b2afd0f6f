"""The throughput knobs in a ``--current`` description: ``compile``, ``float8 tensorwise``,
``float8 rowwise``, ``float8 all-gather`` (TrainConfig's ``compile``, ``float8``,
``float8_all_gather``), as TorchTitan users say them. ``float8`` alone is tensorwise,
TorchTitan's default recipe."""

from __future__ import annotations

from typing import Callable

__all__ = ["KNOBS", "knobs_said"]

# The throughput knobs (TrainConfig's compile, float8, float8_all_gather) as TorchTitan users say them.
KNOBS = {"compile": ("compile", True), "torch.compile": ("compile", True), "compiled": ("compile", True),
          "no compile": ("compile", False), "eager": ("compile", False),
          "float8": ("float8", "tensorwise"), "fp8": ("float8", "tensorwise"),
          "float8 tensorwise": ("float8", "tensorwise"), "fp8 tensorwise": ("float8", "tensorwise"),
          "float8 rowwise": ("float8", "rowwise"), "fp8 rowwise": ("float8", "rowwise"),
          "no float8": ("float8", "none"), "bf16": ("float8", "none"),
          "float8 all-gather": ("float8_all_gather", True), "float8 all gather": ("float8_all_gather", True),
          "fp8 all-gather": ("float8_all_gather", True), "enable-fsdp-float8-all-gather": ("float8_all_gather", True)}


def knobs_said(text: str, said: dict, fail: Callable[[str, str], Exception]) -> tuple[tuple[str, object], ...]:
    """The knobs ``said`` (``parse_current``'s items), checked together: the float8 all-gather
    needs float8 training (``fail(text, why)`` makes the error)."""
    knobs = {k: said[k] for k in ("compile", "float8", "float8_all_gather") if k in said}
    if knobs.get("float8_all_gather") and knobs.get("float8", "none") != "tensorwise":
        raise fail(text, "'float8 all-gather' needs tensorwise float8 training (torchao's "
                         "enable_fsdp_float8_all_gather): add float8 tensorwise")
    return tuple(sorted(knobs.items()))
