"""Helpers the plan-file tests share."""

from __future__ import annotations

import json

from wrapopt.plan import WrapPlan


def load_data(tmp_path, data: dict) -> WrapPlan:
    """``data`` written as a plan file under ``tmp_path`` and loaded back the way users load one."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return WrapPlan.load(path)
