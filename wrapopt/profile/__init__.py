"""Measure the fabric (collective latency per size per mesh axis) and the device's compute.

``measure_fabric`` and ``measure_unit_overhead`` are collective: every rank
of the process group calls them. ``profile_fabric_main`` is the body of
``wrapopt profile-fabric`` and spawns local ranks when not under torchrun.

Modules: ``fabric`` (collective timing), ``compute`` (device timing),
``report`` (``format_fabric``), ``cli`` (the ``profile-fabric`` command).
"""

from __future__ import annotations

from wrapopt.profile.compute import (
    measure_compute,
    measure_module_overhead,
    measure_module_times,
    measure_unit_overhead,
)
from wrapopt.profile.cli import add_cli_arguments, profile_fabric_main, run_cli
from wrapopt.profile.fabric import default_sizes, measure_fabric
from wrapopt.profile.report import format_fabric

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
