"""Measured training steps for plans: the loop that checks the predictions.

All plans are sharded side by side in one process group and stepped
interleaved, one step of each plan per round (See [Note: round order]), so the
machine's noise hits every plan alike; per repeat the step time is the slowest
rank's, and a plan's figure is the median over repeats. Each step is also
split into phases (forward with the loss, backward, optimizer step), each the
slowest rank's, to show where a prediction misses. Peak memory comes from one
extra step per plan: ``torch.cuda.max_memory_allocated`` on CUDA, live tensor
bytes on CPU (``memtrack.LiveBytesTracker``).

[Note: round order] A plan's place in the round may matter on a shared
machine: the first step after a barrier, or the step after one particular
plan, can run slower. So the order changes every round, as the rows of a
Williams design: round r runs ``(w[k] + r) % n`` for
``w = 0, 1, n-1, 2, n-2, ...``. Over n rounds each plan takes every place
once, and for an even n each plan directly follows every other plan once.
Times stay indexed by plan and round, so two plans' k-th times are still
from one round (``evaluate.paired_ratio``).

The warnings a plan's first step raises (FSDP2's "returned a view tensor",
for one) are recorded per plan (``Measured.warnings``), so that a report can
say which plans raised them. Later steps show them as usual (once per place
in the code, Python's default).

[Note: pipeline plans in the bench] A plan with a pipeline (``plan.pipeline``, ``mesh.pp_size >
1``) is applied with ``apply_pipeline`` on a fresh model (the split consumes it) and stepped as
its ``PipelineRun`` runs: ``run.step(inputs, target)`` (the schedule: every micro-batch's forward
and backward, the gradient reduction), then the optimizer step, timed as the other plans are (a
barrier, the wall time of the whole step, the slowest rank's). Its inputs are its data-parallel
position's (``inputs(dp_rank, dp_size)`` with the stage's data-parallel ranks: the global rank
modulo ``dp_size``, the pipeline axis outermost), the first of them the target handed to
``pipeline_loss_fn(output, target)`` on the last stage. The schedule runs forwards and backwards
interleaved, so its phases are two: the forward phase holds the whole schedule step and the
backward phase is 0; the optimizer step is its own. Peak memory tracks the rank's stage modules.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.evaluation.memtrack import steady_phases_peak, steady_step_peak
from wrapopt.launch import dp_rank_size, max_over_ranks
from wrapopt.losses import scalar_loss
from wrapopt.plan.apply import apply_plan, build_mesh
from wrapopt.plan.pipeline import PipelineRun, apply_pipeline, one_microbatch
from wrapopt.spec import PlanSpec
from wrapopt.train import TrainConfig

__all__ = ["Measured", "measure_plans", "round_order"]

PHASES = ("fwd", "bwd", "optim")


@dataclass(frozen=True, slots=True)
class Measured:
    label: str
    step_s: float  # median over repeats of the slowest rank
    times_s: tuple[float, ...]
    spread: float  # (max - min) / median over repeats
    peak_bytes: int  # max over ranks
    losses: tuple[float, ...]
    # median over repeats of the slowest rank's forward (with the loss), backward, optimizer
    phase_s: tuple[float, ...] = ()
    warnings: tuple[str, ...] = ()  # distinct "Category: message" of the warnings its first step raised
    # median over repeats of the CPU seconds the ranks' processes used in the step, summed over the ranks
    cpu_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "step_s": self.step_s, "times_s": list(self.times_s), "spread": self.spread,
                "peak_bytes": self.peak_bytes, "losses": list(self.losses), "phase_s": dict(zip(PHASES, self.phase_s)),
                "warnings": list(self.warnings), "cpu_s": self.cpu_s}


def round_order(n: int, r: int) -> list[int]:
    """The order of ``n`` plans in round ``r``: See [Note: round order]."""
    w = [0]
    lo, hi = 1, n - 1
    while len(w) < n:
        w.append(lo)
        lo += 1
        if len(w) < n:
            w.append(hi)
            hi -= 1
    return [(x + r) % n for x in w]


def _mark(on_cuda: bool) -> Any:
    """A point in time: a recorded CUDA event (no sync, so the step runs as it would), else the clock."""
    if on_cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _phases(marks: list[Any]) -> list[float]:
    """Seconds between consecutive marks (after the step's final synchronize)."""
    if marks and not isinstance(marks[0], float):
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    return [b - a for a, b in zip(marks, marks[1:])]


def _step(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple, loss_fn: Callable,
          mark: Callable[[], None] = lambda: None, micro: int = 1, no_sync: bool = False) -> float:
    """One training step of ``micro`` micro-batches (``inputs`` each; ``no_sync``: only the
    last synchronises gradients, as ``wrapopt.train_step`` runs it); ``mark()`` runs after
    each forward (with the loss), after each backward and after the optimizer step."""
    total = 0.0
    for i in range(micro):
        if no_sync:
            model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
        loss = scalar_loss(loss_fn(model(*inputs), inputs), loss_fn)
        mark()
        (loss / micro if micro > 1 else loss).backward()  # FSDP2's final callback waits for the last reduce-scatter
        mark()
        total += float(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    mark()
    return total / micro


def _step_phases(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple, loss_fn: Callable, micro: int,
                 no_sync: bool) -> list[Callable[[], None]]:
    """``_step`` as separate callables: each micro-batch, then the optimizer step."""
    def one(i: int) -> Callable[[], None]:
        def run() -> None:
            if no_sync:
                model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
            (scalar_loss(loss_fn(model(*inputs), inputs), loss_fn) / micro).backward()
        return run

    def optim() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return [one(i) for i in range(micro)] + [optim]


def _three(ph: list[float]) -> list[float]:
    """Forward, backward and optimizer seconds from the times between marks (forward and
    backward summed over the micro-batches)."""
    return [sum(ph[0:-1:2]), sum(ph[1:-1:2]), ph[-1]]


def _recording(run: Callable[[], float], seen: list[str]) -> float:
    """``run()``, adding the distinct warnings it raises to ``seen`` (recorded, not shown)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run()
    for w in caught:
        text = f"{w.category.__name__}: {w.message}"
        if text not in seen:
            seen.append(text)
    return out


def _inputs_for(plan: PlanSpec, inputs: tuple[Any, ...] | Callable[[int, int], tuple[Any, ...]], mesh: Any) -> tuple:
    """This rank's inputs for ``plan``: ``inputs`` itself, or ``inputs(dp_rank, dp_size)``;
    under tensor parallelism the tensors of the first rank of each tensor-parallel group,
    sent to its peers (they step on one batch: See [Note: applying a 2-D plan] in plan/tp.py)."""
    got = inputs(*dp_rank_size(plan.mesh)) if callable(inputs) else inputs
    got = got if isinstance(got, tuple) else (got,)
    if plan.mesh.tp_size == 1:
        return got
    group = mesh["tp"].get_group()
    out = []
    for x in got:
        if isinstance(x, torch.Tensor):
            x = x.clone().contiguous()
            dist.broadcast(x, group=group, group_src=0)
        out.append(x)
    return tuple(out)


def measure_plans(
    build: Callable[[], nn.Module],
    plans: list[PlanSpec],
    inputs: tuple[Any, ...] | Callable[[int, int], tuple[Any, ...]],
    loss_fn: Callable[[Any, tuple], torch.Tensor],
    *,
    repeats: int = 5,
    warmup: int = 2,
    lr: float = 1e-3,
    measure_memory: bool = True,
    progress: Callable[[str], None] | None = None,
    train: TrainConfig | None = None,
    pipeline_loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> list[Measured]:
    """Run real steps of every plan on the current process group (call on every rank).

    ``build()`` must return the same fresh model on every call (fixed seed).
    ``inputs`` is one rank's inputs, or ``inputs(dp_rank, dp_size)`` giving them per
    data-parallel rank (``wrapopt.launch.dp_rank_size``); a plan with tensor parallelism
    steps every tensor-parallel group on its first rank's inputs.
    ``train`` (default: fp32, one micro-batch, AdamW) gives the mixed precision,
    the optimizer, and ``grad_accumulation`` micro-batches of ``inputs`` per step,
    synchronised as its ``accumulation_sync`` says.
    A pipeline plan (See [Note: pipeline plans in the bench]) needs ``pipeline_loss_fn(output, target)``
    and ``inputs`` as a callable, and one batch per step (no ``grad_accumulation``).
    """

    on_cuda = torch.cuda.is_available()
    micro = train.grad_accumulation if train is not None else 1
    no_sync = micro > 1 and train is not None and train.accumulation_sync == "last"
    if any(p.pipeline is not None for p in plans) and (pipeline_loss_fn is None or not callable(inputs) or micro > 1):
        raise ValueError("measure_plans: a pipeline plan needs pipeline_loss_fn=(output, target), inputs as "
                         "inputs(dp_rank, dp_size), and one micro-batch per step (its schedule splits the batch)")
    models, opts, plan_inputs = _build_plans(build, plans, inputs, lr=lr, train=train,
                                             pipeline_loss_fn=pipeline_loss_fn)
    # Loss parallel's logits are split over the vocabulary: the loss and its backward run under
    # loss_parallel() (See [Note: applying sequence parallel] in plan/tp.py); it changes nothing for plain tensors.
    with _loss_context(plans):
        rounds = _timed_rounds(models, opts, plan_inputs, loss_fn, warmup=warmup, repeats=repeats, micro=micro,
                               no_sync=no_sync, on_cuda=on_cuda, progress=progress)
        peaks = (_measured_peaks(models, opts, plan_inputs, loss_fn, micro=micro, no_sync=no_sync, on_cuda=on_cuda)
                 if measure_memory else [0] * len(plans))
    return [_summary(plan, rounds, i, peaks[i]) for i, plan in enumerate(plans)]


def _loss_context(plans: list[PlanSpec]) -> Any:
    if any(p.tp is not None and p.tp.loss_parallel for p in plans):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def _build_plans(build, plans, inputs, *, lr, train, pipeline_loss_fn=None):
    """One fresh model per plan, sharded as it says (a pipeline plan: its ``PipelineRun``), with its
    optimizer and its inputs."""
    models, opts, plan_inputs = [], [], []
    mp = train.mixed_precision() if train is not None else None
    for plan in plans:
        m = build()
        if plan.pipeline is not None:  # See [Note: pipeline plans in the bench]
            dp = plan.mesh.dp_size
            batch = inputs(dist.get_rank() % dp, dp)
            batch = batch if isinstance(batch, tuple) else (batch,)
            m = apply_pipeline(m, plan, example_inputs=one_microbatch(batch, plan.pipeline.microbatches),
                               loss_fn=pipeline_loss_fn, mixed_precision=mp)
            plan_inputs.append(batch)
        else:
            mesh = build_mesh(plan) if plan.mesh.tp_size > 1 else None  # a 1-D plan builds its own, as before
            apply_plan(m, plan, mesh=mesh, mixed_precision=mp)
            plan_inputs.append(_inputs_for(plan, inputs, mesh))
        models.append(m)
        opts.append(train.make_optimizer(m.parameters(), lr=lr) if train is not None
                    else torch.optim.AdamW(m.parameters(), lr=lr))
    return models, opts, plan_inputs


def _pipeline_step(run: PipelineRun, opt: torch.optim.Optimizer, inputs: tuple, mark: Callable[[], None]) -> float:
    """One step of a pipeline plan: the schedule, then the optimizer; ``mark()`` after each
    (See [Note: pipeline plans in the bench]). The loss is the last stage's (NaN on other ranks)."""
    loss = run.step(inputs, target=inputs[0])
    mark()
    opt.step()
    opt.zero_grad(set_to_none=True)
    mark()
    return float("nan") if loss is None else float(loss)


def _any_step(m: Any, opt: torch.optim.Optimizer, inputs: tuple, loss_fn: Callable,
              mark: Callable[[], None] = lambda: None, micro: int = 1, no_sync: bool = False) -> float:
    """``_step`` of a sharded model, ``_pipeline_step`` of a ``PipelineRun``."""
    if isinstance(m, PipelineRun):
        return _pipeline_step(m, opt, inputs, mark)
    return _step(m, opt, inputs, loss_fn, mark, micro, no_sync)


class _Rounds(NamedTuple):
    """Per plan: every round's loss, the timed rounds' step times, phases and CPU seconds (summed over
    the ranks), what the first round raised."""

    losses: list[list[float]]
    times: list[list[float]]
    phases: list[list[list[float]]]
    raised: list[list[str]]
    cpu: list[list[float]]


def _timed_rounds(models, opts, plan_inputs, loss_fn, *, warmup, repeats, micro, no_sync, on_cuda,
                  progress) -> _Rounds:
    """``warmup + repeats`` rounds, each stepping every plan once in its rotating order."""
    n = len(models)
    losses, times, phases, raised, cpu = ([[] for _ in range(n)] for _ in range(5))
    for r in range(warmup + repeats):
        for i in round_order(n, r):  # See [Note: round order]
            m, o, batch = models[i], opts[i], plan_inputs[i]
            dist.barrier()
            if on_cuda:
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            marks = [_mark(on_cuda)]
            if r == 0:  # a warm-up round unless warmup=0
                loss = _recording(lambda: _any_step(m, o, batch, loss_fn, lambda: marks.append(_mark(on_cuda)), micro,
                                                    no_sync), raised[i])
            else:
                loss = _any_step(m, o, batch, loss_fn, lambda: marks.append(_mark(on_cuda)), micro, no_sync)
            if on_cuda:
                torch.cuda.synchronize()
            dt, *ph = max_over_ranks(time.perf_counter() - t0, *_three(_phases(marks)))
            used = _sum_over_ranks(time.process_time() - c0)  # after the timed step
            if r >= warmup:
                times[i].append(dt)
                phases[i].append(ph)
                cpu[i].append(used)
            losses[i].append(loss)
        if progress:
            progress(f"bench: round {r + 1}/{warmup + repeats}" + (" (warm-up)" if r < warmup else ""))
    return _Rounds(losses, times, phases, raised, cpu)


def _sum_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0])


def _measured_peaks(models, opts, plan_inputs, loss_fn, *, micro, no_sync, on_cuda) -> list[int]:
    """Each plan's peak memory over one more step, the largest over ranks."""
    peaks = [0] * len(models)
    for i, (m, o, batch) in enumerate(zip(models, opts, plan_inputs)):
        dist.barrier()
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            _any_step(m, o, batch, loss_fn, micro=micro, no_sync=no_sync)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            # See [Note: missed frees] in memtrack.py.
            peak = (steady_step_peak(lambda: _pipeline_step(m, o, batch, lambda: None), nn.ModuleList(m.modules), o,
                                     "cpu") if isinstance(m, PipelineRun) else
                    steady_step_peak(lambda: _step(m, o, batch, loss_fn), m, o, "cpu") if micro == 1 else
                    steady_phases_peak(_step_phases(m, o, batch, loss_fn, micro, no_sync), m, o, "cpu"))
        peaks[i] = int(max_over_ranks(float(peak))[0])
    return peaks


def _summary(plan: PlanSpec, rounds: _Rounds, i: int, peak: int) -> Measured:
    times, phases = rounds.times[i], rounds.phases[i]
    med = statistics.median(times)
    return Measured(plan.label, med, tuple(times), (max(times) - min(times)) / med if med else 0.0,
                    peak, tuple(rounds.losses[i]),
                    tuple(statistics.median(p[k] for p in phases) for k in range(len(PHASES))),
                    tuple(rounds.raised[i]), statistics.median(rounds.cpu[i]))
