"""TPE's split of the finished trials, made once per trial, not once per parameter.

[Note: TPE's split once per trial] Optuna's ``TPESampler`` (``multivariate=False``, as
``run_study`` makes it) samples each parameter on its own, and for each one it splits every
finished trial into "below" and "above" (``optuna.samplers._tpe.sampler._split_trials``): for
two objectives, a non-dominated sort and a hypervolume tie-break, and each trial's constraint
read again. A plan has some 20-30 parameters, so a trial repeated the same split that many times:
at 200 trials on llama-tiny, half of the study's time (profiled: 11 of 22 s in the split, of
which 5 s in ``_get_infeasible_trial_score``, called 554,260 times).

``split_once_per_trial`` replaces that module function, while a study runs, with one that
remembers its last answer. The split depends only on the study, the trials given (their
numbers and states: a finished trial's values and constraints never change) and the other
arguments, so the key is those and a changed history (a trial another worker finished in
between) is split afresh. The answer is the same lists, in the same order, so the sampled plans
are the same to the bit (tests/golden holds searches that would show it). Where Optuna has no
such function (a version that renamed it) nothing is replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["split_once_per_trial"]


@contextlib.contextmanager
def split_once_per_trial() -> Iterator[None]:
    """While inside, TPE's split of the trials is computed once per distinct history: See
    [Note: TPE's split once per trial]."""
    try:
        from optuna.samplers._tpe import sampler as tpe
    except ImportError:  # an Optuna without the module: nothing to replace
        yield
        return
    original = getattr(tpe, "_split_trials", None)
    if original is None or getattr(original, "wrapopt_memo", False):  # absent, or replaced already (nested)
        yield
        return
    last: list = [None]  # (key, answer), replaced whole: a study in another thread reads its own pair

    def split(study, trials, *rest):
        key = (id(study), rest, tuple((t.number, t.state) for t in trials))
        hit = last[0]
        if hit is None or hit[0] != key:
            hit = (key, original(study, trials, *rest))
            last[0] = hit
        below, above = hit[1]
        return list(below), list(above)

    split.wrapopt_memo = True  # type: ignore[attr-defined]
    tpe._split_trials = split
    try:
        yield
    finally:
        tpe._split_trials = original
