"""A pipeline step's schedule: the order torch's schedules run each rank's actions in, and
that order run with the stages' times (``run_timeline``) and their memory in flight.

The rules are [Note: pipeline stages] in cost/pipeline.py, which prices each stage
(``StageCost``) and composes the step from the ``Timeline`` this module returns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from wrapopt.spec import CostEstimate

__all__ = ["Action", "StageCost", "Timeline", "held_moment", "run_timeline", "schedule_order"]


# [Note: torch's schedules read late] ``torch.distributed.pipelining`` imports dynamo, DTensor and
# sympy: about a second, paid by every process that imports the simulator. The schedules are read
# only when a pipeline is priced, so they are imported there (``_torch_schedules``), once.
def _torch_schedules() -> Any:
    from torch.distributed.pipelining import schedules

    return schedules

Action = tuple[str, int, int]  # ("F" | "B" | "R", stage, micro-batch; -1 for R)


@dataclass(frozen=True, slots=True)
class StageCost:
    """One stage's figures per micro-batch: See [Note: pipeline stages] in cost/pipeline.py."""

    fwd_s: float
    bwd_s: float
    first_extra_s: float  # the first micro-batch's forward: the kept units' all-gathers
    reduce_s: float  # REDUCE_GRAD after the last backward
    optim_s: float
    static_bytes: float
    kept_bytes: float
    activation_bytes: float  # per micro-batch in flight
    transient_bytes: float
    compute_s: float  # forward and backward compute of one micro-batch
    mb_comm_s: float  # collectives every micro-batch runs (the resharded units' all-gathers)
    once_comm_s: float  # collectives once a step (the kept units' all-gathers, the reduction)
    send_bytes: float  # activation handed to the next stage per micro-batch (0 on the last)
    estimate: CostEstimate  # the stage simulator's, one micro-batch (accumulation 2, sync "last")
    fwd_gathered_s: float | None = None  # forward right after the stage's backward: no all-gathers (None: fwd_s)
    bwd_gathered_s: float | None = None  # backward right after the stage's backward: no re-gathers (None: bwd_s)
    gathered_bytes: float = 0.0  # the resharded units' parameters, gathered: what a backward leaves gathered
    transient_gathered_bytes: float = 0.0  # of transient_bytes, parameters gathered (within gathered_bytes)


@dataclass(frozen=True, slots=True)
class Timeline:
    """``run_timeline``'s answer."""

    end_s: tuple[float, ...]  # per rank, its last action's end
    busy_s: tuple[float, ...]  # per rank, time in its actions
    inflight: tuple[tuple[int, ...], ...]  # per rank, per stage: micro-batches in flight at the rank's worst moment
    events: tuple[tuple[int, str, int, int, float, float], ...] = ()  # rank, kind, stage, micro-batch, start, end
    saved_s: tuple[tuple[float, float], ...] = ()  # per rank, (forward, backward) all-gather time units kept gathered
    held: tuple[tuple[float, float, float], ...] = ()  # per rank, its worst moment with units held: ``held_moment``

    @property
    def makespan_s(self) -> float:
        return max(self.end_s)


@functools.lru_cache(maxsize=256)
def schedule_order(schedule: str, pp_size: int, num_stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per pipeline rank, its actions in the order torch runs them: See [Note: pipeline stages] in cost/pipeline.py."""
    m, p = microbatches, pp_size
    torch_schedules = _torch_schedules()
    if schedule == "GPipe":
        raw = torch_schedules.ScheduleGPipe._get_pipeline_order(SimpleNamespace(_num_stages=p, _n_microbatches=m))
        orders = [raw[r] for r in range(p)]
    elif schedule == "1F1B":
        orders = [_one_f_one_b(r, p, m) for r in range(p)]
    elif schedule == "Interleaved1F1B":
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"Interleaved1F1B needs the micro-batches ({m}) to be a multiple of the rounds "
                             f"({rounds} = max(1, {m} // {p})), as torch's ScheduleInterleaved1F1B requires")
        stub = SimpleNamespace(n_local_stages=num_stages // p, pp_group_size=p, _n_microbatches=m,
                               number_of_rounds=rounds, microbatches_per_round=m // rounds)
        cls = torch_schedules.ScheduleInterleaved1F1B
        orders = [torch_schedules._add_reduce_grad(cls._calculate_single_rank_operations(stub, r), m)
                  for r in range(p)]
    else:
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    return tuple(tuple(_action(a) for a in rank if a is not None) for rank in orders)


def _one_f_one_b(rank: int, p: int, m: int) -> list[Any]:
    """``Schedule1F1B._step_microbatches``'s order on ``rank``, as torch ``_Action`` items."""
    torch_schedules = _torch_schedules()
    act, types = torch_schedules._Action, torch_schedules._ComputationType
    warm = min(m, p - rank)
    out = [act(rank, types.FORWARD, i) for i in range(warm)]
    fwd = warm
    for b in range(m):
        out.append(act(rank, types.FULL_BACKWARD, b))
        if fwd < m:
            out.append(act(rank, types.FORWARD, fwd))
            fwd += 1
    return torch_schedules._add_reduce_grad(out, m)


def _action(a: Any) -> Action:
    kind = a.computation_type.value
    code = {"F": "F", "B": "B", "REDUCE_GRAD": "R"}.get(kind)
    if code is None:
        raise ValueError(f"pipeline action {a} is not priced (only F, B and REDUCE_GRAD)")
    return code, a.stage_index, -1 if a.microbatch_index is None else a.microbatch_index


def run_timeline(order: tuple[tuple[Action, ...], ...], stages: list[StageCost] | tuple[StageCost, ...],
                 send: tuple[float, ...], *, record: bool = False) -> Timeline:
    """Execute the per-rank ``order`` with the stages' times and ``send[s]`` (stage s to s+1):
    See [Note: pipeline stages] in cost/pipeline.py. Raises RuntimeError if the order cannot run
    (a dependency cycle)."""
    last = len(stages) - 1
    fend: dict[tuple[int, int], float] = {}
    bend: dict[tuple[int, int], float] = {}
    p = len(order)
    free, busy, pos = [0.0] * p, [0.0] * p, [0] * p
    after_b = [False] * len(stages)  # the stage's last action was a backward: its units are still gathered
    saved = [[0.0, 0.0] for _ in range(p)]
    events: list[tuple[int, str, int, int, float, float]] = []
    left = sum(map(len, order))
    while left:
        moved = False
        for r in range(p):
            ops, i = order[r], pos[r]
            while i < len(ops):
                kind, s, mb = ops[i]
                st = stages[s]
                if kind == "F":
                    dep = 0.0 if s == 0 else fend.get((s - 1, mb))
                    if dep is None:
                        break
                    ready = dep + (send[s - 1] if s else 0.0)
                    fwd = st.fwd_gathered_s if after_b[s] and st.fwd_gathered_s is not None else st.fwd_s
                    saved[r][0] += st.fwd_s - fwd
                    dur = fwd + (st.first_extra_s if mb == 0 else 0.0)
                    after_b[s] = False
                elif kind == "B":
                    dep = fend.get((s, mb)) if s == last else bend.get((s + 1, mb))
                    if dep is None:
                        break
                    ready = dep + (send[s] if s < last else 0.0)
                    dur = st.bwd_gathered_s if after_b[s] and st.bwd_gathered_s is not None else st.bwd_s
                    saved[r][1] += st.bwd_s - dur
                    after_b[s] = True
                else:
                    ready, dur = 0.0, st.reduce_s
                start = max(free[r], ready)
                end = start + dur
                (fend if kind == "F" else bend)[(s, mb)] = end
                free[r], busy[r] = end, busy[r] + dur
                if record:
                    events.append((r, kind, s, mb, start, end))
                i += 1
                left -= 1
                moved = True
            pos[r] = i
        if not moved:
            raise RuntimeError(f"the pipeline order cannot run: ranks stopped at {pos}")
    return Timeline(tuple(free), tuple(busy), tuple(_inflight(ops, stages) for ops in order), tuple(events),
                    tuple((f, b) for f, b in saved), tuple(held_moment(ops, stages) for ops in order))


def _inflight(ops: tuple[Action, ...], stages: Any) -> tuple[int, ...]:
    """Per stage, the micro-batches in flight on a rank at its worst moment (the most activation
    bytes): a micro-batch holds its activations from its forward to its backward."""
    held = [0] * len(stages)
    worst, worst_bytes = tuple(held), -1.0
    for kind, s, _mb in ops:
        if kind == "F":
            held[s] += 1
            total = sum(n * stages[i].activation_bytes for i, n in enumerate(held) if n)
            if total > worst_bytes:
                worst, worst_bytes = tuple(held), total
        elif kind == "B":
            held[s] -= 1
    return worst


def held_moment(ops: tuple[Action, ...], stages: Any) -> tuple[float, float, float]:
    """(activations in flight, parameters held gathered, transient) at a rank's worst moment while
    units a backward left gathered are held: at the start of each forward and backward of its
    ``ops``; zeros when nothing is ever held. See [Note: pipeline stages] in cost/pipeline.py, the
    memory of units held."""
    n = len(stages)
    inflight, held = [0] * n, [False] * n
    worst, worst_total = (0.0, 0.0, 0.0), 0.0
    for kind, s, _mb in ops:
        if kind == "R":  # REDUCE_GRAD's post_backward reshards them
            held[s] = False
            continue
        params = sum(stages[i].gathered_bytes for i in range(n) if held[i])
        if params > 0:
            acts = sum(k * stages[i].activation_bytes for i, k in enumerate(inflight) if k)
            # the acting stage's transient gathers nothing it already holds
            transient = stages[s].transient_bytes - (stages[s].transient_gathered_bytes if held[s] else 0.0)
            if acts + params + transient > worst_total:
                worst, worst_total = (acts, params, transient), acts + params + transient
        if kind == "F":  # the forward reshards the units after their forward; its activations stay
            inflight[s], held[s] = inflight[s] + 1, False
        else:  # the backward frees its activations and leaves its units gathered
            inflight[s], held[s] = inflight[s] - 1, True
    return worst
