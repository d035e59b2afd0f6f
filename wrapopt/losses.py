"""Losses wrapopt assumes when the user gives none.

Shared by the tracer (what the loss saves for backward), the device
measurement (the loss's time) and the zoo's models.

[Note: the assumed loss] The loss runs after forward and what it keeps for
backward can be a large share of the peak (a cross-entropy over a 32 k
vocabulary keeps a float32 copy of the logits), so a plan is only as good as
the loss it was traced with. Without ``loss_fn`` the tracer takes, in order:
1. the model's own loss: an output that carries a ``loss`` (a Hugging Face
   ``ModelOutput`` or a dict), after ``labels_for`` has given a model with a
   language-modelling head and a ``labels`` argument its input ids as labels
   (Hugging Face models shift them themselves);
2. cross-entropy against the inputs shifted by one, for an output shaped like
   logits over a vocabulary, ``(batch, seq, V)``: V is an ``nn.Embedding``'s
   ``num_embeddings``, or integer token inputs of the same ``(batch, seq)``
   sit beside it and V is no embedding's width (then it is not hidden states);
3. the mean square of every floating output, which keeps the outputs for
   backward; the report names it and says to pass ``loss_fn``.
``DefaultLoss`` records which it took (``LossChoice``) and the tracer keeps it
in ``ModelGraph.loss`` and ``ModelGraph.loss_kind``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from wrapopt.errors import ModelError

__all__ = ["scalar_loss", "default_loss", "next_token_cross_entropy", "LossChoice", "DefaultLoss", "user_loss_choice",
           "labels_for", "LOSS_KINDS", "MEAN_SQUARE_HINT"]

# Closed set of ``LossChoice.kind``: the user's loss_fn, the model's own, the two defaults.
LOSS_KINDS = ("user", "model", "cross_entropy", "mean_square")
MEAN_SQUARE_HINT = ("a guess: this loss keeps every output for backward; pass loss_fn= (the loss you train "
                    "with) to optimize_wrap or trace_model")


@dataclass(frozen=True, slots=True)
class LossChoice:
    """Which loss a trace ran, as the report names it. See [Note: the assumed loss]."""

    kind: str  # one of LOSS_KINDS
    name: str  # "my_pkg.train.loss", "model's own loss", ...
    hint: str = ""  # one line for the user when the choice is a guess worth replacing


_MODEL_OWN = LossChoice("model", "model's own loss (the output's `loss`)")
_MODEL_LABELS = LossChoice("model", "model's own loss, labels = input_ids")
_CROSS_ENTROPY = LossChoice("cross_entropy", "cross-entropy over the vocabulary, next token of the inputs "
                                             "(default for logits-shaped outputs)")
_MEAN_SQUARE = LossChoice("mean_square", "mean square of every output (default)", MEAN_SQUARE_HINT)


def default_loss(output: Any, inputs: tuple[Any, ...] = ()) -> torch.Tensor:
    """A loss for models without one: mean square of every floating output.

    Deterministic and cheap; what matters for planning and parity tests is that
    backward runs through every parameter that took part in forward.
    """
    tensors = _float_tensors(output)
    if not tensors:
        raise ModelError("the model's output holds no floating-point tensor to back-propagate from; pass loss_fn=")
    return sum(t.float().pow(2).mean() for t in tensors)  # type: ignore[return-value]


def next_token_cross_entropy(logits: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy of ``(..., V)`` logits: next-token prediction (``tokens`` shifted by one)
    when the logits are ``(batch, seq, V)`` and ``tokens`` ``(batch, seq)``, else against
    class 0 everywhere (what the loss keeps does not depend on the targets' values)."""
    vocab = logits.shape[-1]
    if tokens is not None and logits.dim() == 3 and tuple(tokens.shape) == tuple(logits.shape[:-1]):
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
    target = torch.zeros(logits.shape[:-1].numel(), dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits.reshape(-1, vocab).float(), target)


class DefaultLoss:
    """The tracer's loss when the user gives none; ``choice`` says which it took.

    ``vocab_sizes`` and ``widths`` are the model's embeddings' ``num_embeddings``
    and ``embedding_dim``. See [Note: the assumed loss].
    """

    def __init__(self, *, vocab_sizes: frozenset[int] = frozenset(), widths: frozenset[int] = frozenset(),
                 labelled: bool = False):
        self.vocab_sizes, self.widths = vocab_sizes, widths
        self.labelled = labelled  # the trace gave the model labels (``labels_for``)
        self.choice: LossChoice | None = None

    @classmethod
    def for_model(cls, model: nn.Module, *, labelled: bool = False) -> "DefaultLoss":
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        return cls(vocab_sizes=frozenset(m.num_embeddings for m in embeddings),
                   widths=frozenset(m.embedding_dim for m in embeddings), labelled=labelled)

    def __call__(self, output: Any, inputs: tuple[Any, ...] = ()) -> torch.Tensor:
        own = _output_loss(output)
        if own is not None:
            self.choice = _MODEL_LABELS if self.labelled else _MODEL_OWN
            return own
        logits = _logits_of(output)
        tokens = _tokens_like(inputs, logits)
        if logits is not None and logits.dim() == 3 and (logits.shape[-1] in self.vocab_sizes or (
                tokens is not None and logits.shape[-1] not in self.widths)):
            self.choice = _CROSS_ENTROPY
            return next_token_cross_entropy(logits, tokens)
        self.choice = _MEAN_SQUARE
        return default_loss(output, inputs)


def scalar_loss(loss: Any, loss_fn: Callable[..., Any]) -> torch.Tensor:
    """``loss`` when it is a one-element tensor (what ``backward()`` takes), else ``ModelError``
    naming ``loss_fn``, what it returned and the fix. Every caller of a ``loss_fn`` goes through it."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    own = isinstance(loss_fn, DefaultLoss) and loss_fn.choice is not None
    name = loss_fn.choice.name if own else user_loss_choice(loss_fn).name  # type: ignore[union-attr]
    raise ModelError(f"loss_fn {name} returned {what}, not a scalar; reduce it to one "
                     "number, e.g. return loss.mean() (or .sum())")


def user_loss_choice(loss_fn: Callable[..., Any]) -> LossChoice:
    """How the report names a user's ``loss_fn``: its module and qualified name."""
    fn = getattr(loss_fn, "func", loss_fn)  # functools.partial
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return LossChoice("user", f"{module}.{qual}" if module and module != "__main__" else qual)


def labels_for(model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``kwargs`` plus ``labels=input_ids`` when the model computes its own token loss, else None.

    That is: its forward takes ``labels`` (not given here), it has a language-modelling
    head (Hugging Face's ``get_output_embeddings()`` is a module) and an integer
    ``input_ids`` tensor is among the inputs. See [Note: the assumed loss].
    """
    head = getattr(model, "get_output_embeddings", None)
    try:
        if not callable(head) or not isinstance(head(), nn.Module):
            return None
        signature = inspect.signature(model.forward)
        if "labels" not in signature.parameters:
            return None
        bound = signature.bind_partial(*inputs, **kwargs).arguments
    except (TypeError, ValueError, NotImplementedError):  # no signature, or the inputs do not bind
        return None
    ids = bound.get("input_ids")
    if "labels" in bound or not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        return None
    return {**kwargs, "labels": ids}


def _output_loss(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1 and loss.requires_grad:
        return loss
    return None


def _logits_of(output: Any) -> torch.Tensor | None:
    """The output's logits: its ``logits`` field, the output itself, or its first floating tensor."""
    cand = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if cand is None:
        tensors = _float_tensors(output)
        cand = tensors[0] if tensors else None
    if isinstance(cand, torch.Tensor) and cand.is_floating_point() and cand.dim() >= 2:
        return cand
    return None


def _tokens_like(inputs: tuple[Any, ...], logits: torch.Tensor | None) -> torch.Tensor | None:
    """An integer input of the logits' leading (batch, seq) shape, if there is one."""
    if logits is None or logits.dim() != 3:
        return None
    for t in inputs:
        if (isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool
                and tuple(t.shape) == tuple(logits.shape[:2])):
            return t
    return None


def _float_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, dict) or hasattr(obj, "values") and callable(obj.values):
        return [t for v in obj.values() for t in _float_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _float_tensors(v)]
    return []
