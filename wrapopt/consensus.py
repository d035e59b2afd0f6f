"""Every rank explains: one consistency check across ranks, and local failures made collective.

Two helpers for code that runs on every rank of a process group (``torchrun``
or ``launch.spawn``), each a collective that every rank must reach:

- ``agree(what, facts)``: the ranks compare what they were given (model
  fingerprint, example input shapes and dtypes, world size, plan, options)
  before any collective that a difference would hang or corrupt. A
  disagreement raises the same ``RanksDisagreeError`` on every rank, naming
  the ranks and the fact that differs.
- ``every_rank(what)``: a context manager around *local* work (no
  collective inside: tracing, reading a plan, a forward that is timed). On
  exit the ranks exchange their outcome; when some ranks raised, every rank
  raises ``RankFailedError`` naming the failing rank(s) and the message, a
  failing rank chained to its own exception. When every rank raised, each
  raises its own error, as it would alone.

See [Note: every rank explains].

Outside a process group both are no-ops (``every_rank`` lets the exception
through unchanged), so single-process code calls them unconditionally.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

from wrapopt.errors import RankFailedError, RanksDisagreeError
from wrapopt.rank_faults import lost_rank_error

__all__ = ["agree", "every_rank", "input_facts"]

# [Note: every rank explains]
# A rank that raises on its own leaves its peers in the next collective, where they wait for
# the process group's timeout and then print gloo's "Connection closed by peer" (or die from
# torchrun's SIGTERM) with no word of the cause. So wrapopt keeps what can fail locally (the
# trace, the plan file, the fingerprint check, a timed forward) out of collectives, and ends
# each such stretch with one exchange of the outcome (``every_rank``): a few bytes of JSON per
# rank through ``all_gather_object`` (our own strings, never a user's object). Every rank then
# knows who failed and why, and raises the same error. Facts the ranks must share are compared
# the same way (``agree``) before the first collective that a difference would hang or corrupt:
# a model with one more layer on one rank would otherwise reach FSDP's post-backward with a
# reduce-scatter its peers never issue. Both run under the process group's timeout, so a rank
# that never arrives still ends in an error, never a hang; that error names the rank lost (See
# [Note: survivors name the lost rank] in wrapopt/rank_faults.py).


def _in_group() -> bool:
    """A real process group: on the ``fake`` backend (FSDPMemTracker's one-process runs of a
    world) there are no other ranks to hear from."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


def _gather_text(text: str) -> list[str]:
    out: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, text)
    except Exception as e:  # a rank that never arrives: name it (See [Note: survivors name the lost rank])
        named = lost_rank_error(e)
        if named is None:
            raise
        raise named from e
    return [str(x) for x in out]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def agree(what: str, facts: dict[str, Any]) -> None:
    """Check that every rank holds the same ``facts`` (JSON-able values), a collective.

    Raises ``RanksDisagreeError`` on every rank, naming for each differing fact
    the ranks that differ from rank 0 and both values.

    Example:
        >>> agree("applying the plan", {"world_size": 1})  # no process group: nothing to compare
    """
    if not _in_group():
        return
    mine = json.dumps(facts, sort_keys=True, default=str)
    seen = [json.loads(t) for t in _gather_text(mine)]
    lines = []
    for key in sorted(seen[0]):
        differ = [r for r, f in enumerate(seen) if f.get(key) != seen[0].get(key)]
        if differ:
            lines.append(f"{key}: rank 0 has {_short(seen[0].get(key))}, {_ranks(differ)} "
                         f"{'has' if len(differ) == 1 else 'have'} {_short(seen[differ[0]].get(key))}")
    if lines:
        raise RanksDisagreeError(
            f"the ranks disagree while {what}: " + "; ".join(lines)
            + ". Every rank must be given the same model, example input shapes, plan and options.")


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def every_rank(what: str) -> Iterator[None]:
    """Run a stretch of local work (no collective inside) whose failure every rank must hear of.

    On exit the ranks exchange their outcome (a collective). If some ranks raised,
    every rank raises ``RankFailedError`` naming the failing ranks and the first
    one's message; on a failing rank it is chained to the rank's own exception.
    If every rank raised, each raises its own exception unchanged.

    Example:
        >>> with every_rank("tracing the model"):  # no process group: plain local code
        ...     x = 1 + 1
    """
    if not _in_group():
        yield
        return
    failure: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 (every kind must reach the peers, or they hang)
        failure = e
    status = "" if failure is None else f"{type(failure).__name__}: {failure}"
    outcomes = _gather_text(status)
    failed = [r for r, s in enumerate(outcomes) if s]
    if not failed:
        return
    if failure is not None and len(failed) == len(outcomes):
        raise failure  # every rank failed: each raises its own error, as it would alone
    first = outcomes[failed[0]]
    err = RankFailedError(f"{_ranks(failed)} failed while {what}: {first}", ranks=tuple(failed))
    if failure is not None:
        raise err from failure
    raise err


def input_facts(inputs: Any) -> Any:
    """The shapes and dtypes of example inputs (nested tuples, lists, dicts of tensors), as JSON."""
    if isinstance(inputs, torch.Tensor):
        return [list(inputs.shape), str(inputs.dtype).removeprefix("torch.")]
    if isinstance(inputs, (tuple, list)):
        return [input_facts(x) for x in inputs]
    if isinstance(inputs, dict):
        return {str(k): input_facts(v) for k, v in sorted(inputs.items(), key=lambda kv: str(kv[0]))}
    if inputs is None or isinstance(inputs, (bool, int, float, str)):
        return inputs
    return type(inputs).__name__
