"""The plan file's JSON Schema (``wrapopt/data/plan.schema.json``) and a small validator
for the subset of draft 2020-12 it uses, so that loading a plan needs the standard
library only. ``WrapPlan.from_json`` gives pointed messages for the fields it reads
itself and this validator catches the rest (unknown fields, wrong types).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from wrapopt.errors import PlanError
from wrapopt.fileio import read_json

__all__ = ["plan_schema", "schema_errors", "short_json"]


def plan_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the plan file, ``wrapopt/data/plan.schema.json``."""
    global _SCHEMA
    if _SCHEMA is None:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "plan.schema.json")
        _SCHEMA = read_json(path, error=PlanError)
    return _SCHEMA


_SCHEMA: dict[str, Any] | None = None


def schema_errors(data: Any, schema: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """Where ``data`` breaks the plan schema: ``[(field, message), ...]``, empty when it conforms.

    A small validator for the subset of draft 2020-12 the schema uses (``type``,
    ``const``, ``enum``, ``required``, ``properties``, ``additionalProperties``,
    ``items``, ``prefixItems``, ``minItems``, ``minimum``, ``pattern``,
    ``anyOf``, ``allOf``, local ``$ref``), so that loading a plan needs the
    standard library only. Fields are written as in error messages:
    ``units[0].modules``.
    """
    root = plan_schema() if schema is None else schema
    out: list[tuple[str, str]] = []
    _check_node(data, root, root, "", out)
    return out


_JSON_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_SUPPORTED = {"type", "const", "enum", "required", "properties", "additionalProperties", "items", "prefixItems",
              "minItems", "minimum", "pattern", "anyOf", "allOf", "$ref", "$schema", "$id", "$defs", "title",
              "description"}


def _check_node(v: Any, node: dict[str, Any], root: dict[str, Any], where: str, out: list[tuple[str, str]]) -> None:
    unsupported = set(node) - _SUPPORTED
    assert not unsupported, f"plan schema uses keywords the validator lacks: {unsupported}"  # internal invariant
    name = where or "<plan>"
    if "$ref" in node:
        target: Any = root
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        _check_node(v, target, root, where, out)
    if "type" in node:
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        if not any(_JSON_TYPES[t](v) for t in types):
            out.append((name, f"must be {' or '.join(types)}, got {_json_type(v)} {short_json(v)}"))
            return
    if "const" in node and v != node["const"]:
        out.append((name, f"must be {node['const']!r}, got {short_json(v)}"))
    if "enum" in node and v not in node["enum"]:
        out.append((name, f"must be one of {', '.join(map(json.dumps, node['enum']))}, got {short_json(v)}"))
    if "minimum" in node and _JSON_TYPES["number"](v) and v < node["minimum"]:
        out.append((name, f"must be at least {node['minimum']}, got {v!r}"))
    if "pattern" in node and isinstance(v, str) and not re.search(node["pattern"], v):
        out.append((name, f"must match {node['pattern']}, got {v!r}"))
    if "anyOf" in node:
        branches = [[] for _ in node["anyOf"]]
        for sub, errs in zip(node["anyOf"], branches):
            _check_node(v, sub, root, where, errs)
        if all(branches):
            deeper = [b for b in branches if b[0][0] != name]  # a branch that matched the type, then failed inside
            if deeper:
                out.append(deeper[0][0])
            else:
                out.append((name, "; or ".join(b[0][1] for b in branches)))
    for sub in node.get("allOf", ()):
        _check_node(v, sub, root, where, out)
    if isinstance(v, dict):
        props = node.get("properties", {})
        for key in node.get("required", ()):
            if key not in v:
                out.append((_join(where, key), "is missing"))
        extra = node.get("additionalProperties", True)
        for key, item in v.items():
            if key in props:
                _check_node(item, props[key], root, _join(where, key), out)
            elif extra is False:
                known = ", ".join(props)
                out.append((_join(where, key), f"is not a field of {name} (known fields: {known})"))
            elif isinstance(extra, dict):
                _check_node(item, extra, root, _join(where, key), out)
    if isinstance(v, list):
        if len(v) < node.get("minItems", 0):
            out.append((name, f"must have at least {node['minItems']} item(s), got {len(v)}"))
        prefix = node.get("prefixItems", ())
        for i, item in enumerate(v):
            sub = prefix[i] if i < len(prefix) else node.get("items")
            if sub is not None:
                _check_node(item, sub, root, f"{where}[{i}]", out)


def _join(where: str, key: str) -> str:
    if not where:
        return key
    return f"{where}.{key}" if key.isidentifier() else f"{where}[{key!r}]"


def _json_type(v: Any) -> str:
    return next((t for t, ok in _JSON_TYPES.items() if t != "number" and ok(v)), "number")


def short_json(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, float) or v == v else "NaN"
    return text if len(text) <= 40 else text[:37] + "..."
