"""Measure the fabric (collective latency per size per mesh axis) and the device's compute.

``measure_fabric`` and ``measure_unit_overhead`` are collective: every rank
of the process group calls them. ``profile_fabric_main`` is the body of
``wrapopt profile-fabric`` and spawns local ranks when not under torchrun.
"""

from __future__ import annotations

from wrapopt.profile.compute import (
    measure_compute,
    measure_module_overhead,
    measure_module_times,
    measure_unit_overhead,
)
from wrapopt.profile.fabric import (
    add_cli_arguments,
    default_sizes,
    format_fabric,
    measure_fabric,
    profile_fabric_main,
    run_cli,
)

__all__ = [
    "measure_fabric",
    "default_sizes",
    "profile_fabric_main",
    "add_cli_arguments",
    "run_cli",
    "format_fabric",
    "measure_compute",
    "measure_module_times",
    "measure_module_overhead",
    "measure_unit_overhead",
]
