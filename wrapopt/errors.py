"""One exception root, with a subclass per stage (optuna's ``exceptions.py`` pattern).

Every message says what was wrong and what to do about it. The CLI turns any
``WrapoptError`` into exit code 1 and a one-line message.
"""

from __future__ import annotations

__all__ = [
    "WrapoptError",
    "ModelError",
    "TraceError",
    "ProfileError",
    "PlanError",
    "PlanMismatchError",
    "InfeasibleError",
    "DistributedError",
    "RankFailedError",
    "RanksDisagreeError",
    "OptionError",
]


class WrapoptError(Exception):
    """Base class of every error wrapopt raises on purpose."""


class ModelError(WrapoptError, ValueError):
    """The model or its example inputs cannot be used (no parameters, bad name, ...)."""


class TraceError(WrapoptError):
    """The model's forward or backward failed while tracing; names the module."""


class ProfileError(WrapoptError):
    """A fabric or compute profile is malformed, missing, or does not fit the mesh."""


class PlanError(WrapoptError, ValueError):
    """A plan is illegal (uncovered or split parameters) or a plan file is malformed."""


class PlanMismatchError(PlanError):
    """A plan file was made for a different model; the message names what differs."""


class InfeasibleError(WrapoptError):
    """No plan fits the memory budget; the message gives the smallest peak and what would help."""


class DistributedError(WrapoptError, RuntimeError):
    """A multi-process step failed or timed out; names the rank when known."""


class RankFailedError(DistributedError):
    """A rank failed in work every rank does; raised on every rank, naming the failing ranks
    (``ranks``) and the first one's message (See [Note: every rank explains] in wrapopt/consensus.py)."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = ranks


class RanksDisagreeError(DistributedError):
    """The ranks were given different models, inputs, plans or options; raised on every rank,
    naming the ranks and what differs."""


class OptionError(WrapoptError, ValueError):
    """An argument or option has a value wrapopt cannot use; names the argument and what it accepts."""
