"""Peak live tensor bytes of a real step on any device (CPU included).

CUDA has ``torch.cuda.max_memory_allocated``; CPU has nothing like it, and
process RSS mixes in the allocator, the interpreter and libraries. So on CPU
the benchmark counts what the cost model predicts: bytes of tensor storage
alive at each instant of the step.

How: at the start the bytes held by what the step can touch are summed once
(the model's parameters, buffers and gradients, the optimizer's state and
FSDP2's internal buffers; other models in the process are not counted).
During the step PyTorch's profiler records every allocation and free of the
CPU allocator (``profile_memory=True``), storage resizes included (FSDP2 frees
and re-allocates unsharded parameters by resizing storage). The peak is the
start figure plus the highest running sum of those events.

[Note: missed frees] The profiler records allocator events only on threads
where it is enabled. A collective's buffer whose last reference drops on the
backend's worker thread (gloo's async work object dies there, a moment after
the main thread's ``wait()``) is freed without an event, so the running sum
stays too high from then on, and the step's events do not sum to zero. A
steady-state step leaves memory as it found it, so ``steady_step_peak`` runs a
few steps and keeps the one whose events balance (net sum nearest zero; every
rank runs the same number, so collectives stay matched), running more (up to
8) until every rank has a balanced one: a few steps can all miss a free on
some rank. Profiling all threads (``profile_all_threads``) drops memory events
altogether in torch 2.13. A step of several micro-batches runs several
collectives' worth of missed frees: ``steady_phases_peak`` tracks each
micro-batch (and the optimizer step) on its own, from the live bytes at its
start, so they do not add up.

[Note: profiler lines] Kineto prints "USDT ... profiler_start" and "...
profiler_stop" from C++ each time the profiler starts and stops: two lines a
step. In a rank started by ``launch.spawn`` they are handled there (See
[Note: quiet ranks] in launch.py). In any other process (the user's own,
under torchrun) fd 2 points at ``profiler_log_path()`` (a file in a private
per-process directory, never a shared fixed name) only while the profiler
starts and stops, and back at once: the user's own output is not touched.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from wrapopt.launch import max_over_ranks, profiler_lines_to_log, profiler_log_path

__all__ = ["LiveBytesTracker", "steady_step_peak", "steady_phases_peak", "profiler_log_path"]

def _local(t: torch.Tensor) -> torch.Tensor | None:
    if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
        return t
    inner = getattr(t, "_local_tensor", None)  # DTensor
    return inner if isinstance(inner, torch.Tensor) else None


class LiveBytesTracker:
    """``with LiveBytesTracker(model, optimizer) as m: step()`` then ``m.peak_bytes``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, device: str = "cpu"):
        self.device = torch.device(device).type
        self._model, self._optimizer = model, optimizer
        self._refs: list[weakref.ref] = []
        self.peak_bytes = 0
        self.start_bytes = 0
        self.net_bytes = 0  # sum of the step's allocator events: 0 for a balanced steady-state step

    def _seed(self) -> None:
        for t in list(self._model.parameters()) + list(self._model.buffers()):
            self._add(t)
            if t.grad is not None:
                self._add(t.grad)
        if self._optimizer is not None:
            for st in self._optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        self._add(v)
        for m in self._model.modules():
            get_state = getattr(m, "_get_fsdp_state", None)
            group = getattr(get_state(), "_fsdp_param_group", None) if get_state else None
            # An all-gather output FSDP2 still holds (torch 2.13 frees the last one at the root's
            # post-forward, so none between steps; older versions kept it into the next step).
            ag_state = getattr(getattr(group, "comm_ctx", None), "all_gather_state", None)
            if ag_state is not None:
                self._add_any(getattr(ag_state.all_gather_result, "all_gather_output", None))
            for fp in getattr(group, "fsdp_params", []) or []:
                for v in vars(fp).values() if hasattr(fp, "__dict__") else []:
                    self._add_any(v)
                for name in getattr(type(fp), "__slots__", ()):
                    self._add_any(getattr(fp, name, None))

    def _add_any(self, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            self._add(v)
            if v.grad is not None:  # the unsharded parameter's gradient, kept across no-sync micro-batches
                self._add(v.grad)
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor):
                    self._add(x)

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._seed()
        self.start_bytes = self._live()
        self._refs = []
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with profiler_lines_to_log():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        with profiler_lines_to_log():
            self._prof.__exit__(*exc)
        events = sorted(
            (e.start_ns(), e.nbytes()) for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"
        )
        running = best = 0
        for _, nbytes in events:
            running += nbytes
            best = max(best, running)
        self.peak_bytes = self.start_bytes + best
        self.net_bytes = running
        return False

    def _add(self, t: torch.Tensor) -> None:
        loc = _local(t)
        if loc is not None and loc.device.type == self.device and not loc.is_meta:
            try:
                self._refs.append(weakref.ref(loc))
            except TypeError:
                pass

    def _live(self) -> int:
        seen: dict[int, int] = {}
        alive = []
        for r in self._refs:
            t = r()
            if t is None:
                continue
            alive.append(r)
            try:
                s = t.untyped_storage()
                ptr = s.data_ptr()
                if ptr:
                    seen[ptr] = max(seen.get(ptr, 0), s.nbytes())
            except (RuntimeError, NotImplementedError):
                continue
        self._refs = alive
        return sum(seen.values())


def steady_step_peak(step: Callable[[], Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                     device: str = "cpu", *, tries: int = 3, max_tries: int = 8) -> int:
    """Peak live bytes of one steady-state ``step()``: runs it ``tries`` times, and on
    up to ``max_tries`` until every rank has a step whose allocator events balance (the
    same count on every rank), and returns the lowest peak of the steps that balance
    best. See [Note: missed frees]."""
    best: tuple[int, int] | None = None  # (|net|, peak)
    for k in range(max(1, max_tries)):
        with LiveBytesTracker(model, optimizer, device) as tr:
            step()
        this = (abs(tr.net_bytes), tr.peak_bytes)
        best = this if best is None else min(best, this)
        # Every rank balanced: the same answer everywhere, so all run the same number of steps.
        if k + 1 >= tries and max_over_ranks(best[0])[0] == 0:
            break
    return best[1]


def steady_phases_peak(phases: list[Callable[[], Any]], model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer | None = None, device: str = "cpu", *, tries: int = 3) -> int:
    """Peak live bytes of one steady-state step run as ``phases`` (each micro-batch's
    forward and backward, then the optimizer step), each tracked on its own from the
    bytes alive at its start: See [Note: missed frees]. Runs the step ``tries`` times
    and keeps the one whose phases balance best."""
    best: tuple[float, int] | None = None
    for _ in range(max(1, tries)):
        peak, drift = 0, 0.0
        for i, phase in enumerate(phases):
            with LiveBytesTracker(model, optimizer, device) as tr:
                phase()
            peak = max(peak, tr.peak_bytes)
            if i:  # the first micro-batch creates the gradients: it never balances
                drift += abs(tr.net_bytes)
        if best is None or drift < best[0]:
            best = (drift, peak)
    return best[1]
