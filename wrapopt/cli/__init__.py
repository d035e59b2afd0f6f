"""cli: ``wrapopt`` and its sub-commands (``python -m wrapopt.cli`` runs it too)."""

from wrapopt.cli.main import build_parser, main

__all__ = ["main", "build_parser"]
