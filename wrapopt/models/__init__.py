"""models: where models come from (the zoo, ``package.module:callable``, Hugging Face configs)."""

from wrapopt.models import zoo
from wrapopt.models.base import ModelSource
from wrapopt.models.sources import resolve_model

__all__ = ["zoo", "ModelSource", "resolve_model"]
