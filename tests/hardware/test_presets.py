"""hardware/presets.py: analytical profiles say so, in their label, their table and their file."""

from __future__ import annotations

from wrapopt.hardware.presets import analytical_fabric
from wrapopt.hardware.profiles import FabricProfile
from wrapopt.report.fabric import format_fabric


def test_analytical_profile_is_labelled_everywhere(tmp_path) -> None:
    fabric = analytical_fabric("h100-nvlink-ib400", world_size=16)
    assert fabric.kind == "analytical" and "analytical" in fabric.label
    text = format_fabric(fabric)
    assert text.splitlines()[0] == "fabric h100-nvlink-ib400: ANALYTICAL (stated numbers, not measured)"
    assert "MEASURED" not in text and "ring model, analytical" in text
    path = tmp_path / "a.json"
    fabric.save(str(path))
    assert FabricProfile.load(str(path)).kind == "analytical"
