"""trace: model -> ModelGraph, on the meta device (no weights)."""

from wrapopt.trace.meta import trace_model

__all__ = ["trace_model"]
