"""interop: a plan in the configuration formats of frameworks (Accelerate, Lightning)."""

from wrapopt.interop.export import TARGETS, Export, export_plan

__all__ = ["TARGETS", "Export", "export_plan"]
