"""The throughput knobs a job runs with: compile settled by default, float8 searched when asked.

[Note: knob defaults] TorchTitan users turn on two knobs that move throughput more than any
wrapping choice (issue 52): ``training.compile`` and the float8 converter. Their defaults here:

- **compile** (``TrainConfig.compile`` None, neither ``--compile`` nor ``--no-compile`` given)
  is on where it applies: on a stated GPU (an analytical compute profile) the step is priced
  and applied compiled per block, as TorchTitan's Llama configs run it. It is not searched:
  the cost model never prices compiled slower than eager (See [Note: compile costs] in
  cost/fused.py: fused bytes are taken only where fewer, saved bytes only shrink), so a search
  would always answer "on". It is off on a measured profile, whose kernel times are eager
  ones (on a CPU, inductor's C++ compile of the blocks also costs 30 s and more cold, which a
  short CPU job never earns back: llama-tiny's 6 blocks, compiled each with ``fullgraph=True``,
  took 163 s to the end of the first step on one thread of a busy 2-core machine, then 0.05 s a
  step), and off when ``optimize_wrap`` applies the plan on CPU ranks.
- **float8** changes numerics (torchao's E4M3 casts of the linears' inputs, weights and
  gradients), so TorchTitan users opt in (``model.converters = ["float8"]``) and so does
  wrapopt: the default is ``none``, and on a GPU with FP8 tensor cores the knob lines name
  what tensorwise float8 would gain on the chosen plan (``float8_hint``). ``--float8 auto``
  (``float8="auto"``) searches it: none, tensorwise, tensorwise with the float8 all-gather
  (where FSDP gathers: a shard group over 1) and rowwise, each screened (``SCREEN``: the
  search without the study), then the fastest gets the whole search (``search_float8``).
  Never on a GPU without FP8 tensor cores (A100: ``fp8_flops_per_s`` 0) nor on a measured
  profile (its GEMMs were timed in bf16/fp32, it has no FP8 rate): one line says why. An
  explicit ``--float8 none|tensorwise|rowwise`` fixes it.

Each line goes into the report (``SearchResult.knobs``) and the plan file's notes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.spec import MeshSpec, PlanSpec
from wrapopt.train import FLOAT8_AUTO, TrainConfig

__all__ = ["settle_compile", "float8_choices", "float8_words", "float8_hint", "search_float8", "Float8Choice",
           "fp8_missing"]

CPU_COMPILE_COLD_S = 30  # inductor's cold C++ compile of a small model's blocks on a CPU, at least (See the note)


def settle_compile(train: TrainConfig, compute: Any, *, apply_device: str | None = None) -> tuple[TrainConfig, str]:
    """``train`` with ``compile`` settled against the compute profile (and, under ``optimize_wrap``
    in a process group, ``apply_device``, the device the plan is applied on), and one line saying
    on or off and why: See [Note: knob defaults]."""
    if train.compile is not None:
        flag = "--compile, compile=True" if train.compile else "--no-compile, compile=False"
        return train, f"compile: {'on' if train.compile else 'off'}, as the step gives it ({flag} or a plan file's)"
    if apply_device == "cpu":
        return replace(train, compile=False), (
            f"compile: off by default when the plan is applied on CPU ranks (inductor's CPU compile costs "
            f"{CPU_COMPILE_COLD_S} s and more cold, more than a short CPU job gains); compile=True turns it on")
    if compute.kind != "analytical":
        return replace(train, compile=False), (
            f"compile: off by default on a measured profile ({compute.device}): its kernel times are eager ones"
            + (f", and inductor's CPU compile costs {CPU_COMPILE_COLD_S} s and more cold"
               if "cpu" in str(compute.device) else "") + "; --compile prices and applies each block compiled")
    return replace(train, compile=True), (
        f"compile: on by default on a stated GPU ({compute.device}), as TorchTitan runs it: each block "
        "torch.compile'd (fullgraph) after fully_shard; --no-compile (compile=False) prices it eager")


def fp8_missing(compute: Any) -> str | None:
    """Why float8 is never tried on ``compute`` (a clause), or None: it has FP8 tensor cores."""
    if compute.kind != "analytical":
        return f"a measured profile ({compute.device}) has no FP8 rate: its GEMMs were timed without float8"
    if not compute.meta.get("fp8_flops_per_s"):
        gpu = compute.meta.get("gpu") or compute.device
        return f"{gpu} has no FP8 tensor cores" if "fp8_peak_flops_per_s" in compute.meta else (
            f"{gpu} states no FP8 rate (fp8_peak_flops_per_s)")
    return None


def float8_words(train: TrainConfig) -> str:
    """A step's float8 as the report says it."""
    if train.float8 == "none":
        return "none"
    return train.float8 + (" with the float8 all-gather" if train.float8_all_gather else "")


def _converts(sim: Simulator, recipe: str) -> bool:
    """Whether ``recipe`` converts any linear of ``sim``'s model (TorchTitan's filter, cost/fused.py)."""
    opts = replace(sim.options, float8=recipe, float8_all_gather=False)
    return bool(Simulator(sim.traced, sim.fabric, sim.compute, opts, backend=sim.backend,
                          host=sim.host).compute.meta.get("float8_modules"))


def float8_choices(train: TrainConfig, compute: Any, mesh: MeshSpec,
                   sim: Simulator | None = None) -> tuple[tuple[TrainConfig, ...], str]:
    """The float8 steps to search, and the knob line when it is settled without a search ("" when
    a search or the hint will say it): See [Note: knob defaults]. With ``sim`` (the job's), a
    recipe that converts no linear of the model is not tried."""
    if train.float8 != FLOAT8_AUTO:
        if train.float8 == "none":
            return (train,), ""
        return (train,), f"float8: {float8_words(train)}, as asked (--float8 {train.float8})"
    off = replace(train, float8="none", float8_all_gather=False)
    why = fp8_missing(compute)
    if why:
        return (off,), f"float8: not tried (--float8 auto), {why}"
    recipes = [r for r in ("tensorwise", "rowwise") if sim is None or _converts(sim, r)]
    if not recipes:
        return (off,), ("float8: not tried (--float8 auto), no linear passes TorchTitan's float8 filter (both "
                        "dimensions divisible by 16, not the output head, not too small for torchao's auto filter)")
    steps = [off]
    for r in recipes:
        steps.append(replace(off, float8=r))
        if r == "tensorwise" and mesh.shard_size > 1:  # FSDP gathers: the float8 all-gather applies
            steps.append(replace(off, float8=r, float8_all_gather=True))
    return tuple(steps), ""


@dataclass(frozen=True, slots=True)
class Float8Choice:
    """What ``search_float8`` found: the answer (``run``'s), its step, and the knob line."""

    found: Any
    train: TrainConfig
    line: str


def search_float8(steps: tuple[TrainConfig, ...], run: Callable[[TrainConfig, bool], Any],
                  best_of: Callable[[Any], Any]) -> Float8Choice:
    """Each of ``steps`` screened (``run(step, True)``: the search without the study), then the
    fastest fitting one searched whole (``run(step, False)``): See [Note: knob defaults]. With
    one step, only the whole search. ``best_of(found)`` is the answer's ``Scored``. Raises
    ``InfeasibleError`` when nothing fits under any step."""
    if len(steps) == 1:
        return Float8Choice(run(steps[0], False), steps[0], "")
    screened: list[tuple[TrainConfig, float | None]] = []
    err: InfeasibleError | None = None
    for step in steps:
        try:
            best = best_of(run(step, True))
        except InfeasibleError as e:
            err = err or e
            screened.append((step, None))
            continue
        screened.append((step, best.estimate.step_s if best.fits else None))
    fitting = [(s, t) for s, t in screened if t is not None]
    if not fitting:
        raise err or InfeasibleError("no plan fits under any float8 recipe")
    chosen = min(fitting, key=lambda st: st[1])[0]
    found = run(chosen, False)
    rows = ", ".join(f"{float8_words(s)} " + (f"{t * 1e3:.2f} ms" if t is not None else "nothing fits")
                     for s, t in screened)
    line = (f"float8: {float8_words(chosen)} chosen (--float8 auto), {best_of(found).estimate.step_s * 1e3:.2f} ms "
            f"per step; screened without the study: {rows}")
    return Float8Choice(found, chosen, line)


def float8_hint(sim: Simulator, plan: PlanSpec, step_s: float, compute: Any) -> str:
    """The knob line for float8 left off by default: on a GPU with FP8 tensor cores, what tensorwise
    float8 (with the float8 all-gather where FSDP gathers) would gain on ``plan``, priced by
    ``sim`` with float8 on; elsewhere why it is not tried. See [Note: knob defaults]."""
    why = fp8_missing(compute)
    if why:
        return f"float8: off, not tried: {why}"
    gather = plan.mesh.shard_size > 1
    opts = replace(sim.options, float8="tensorwise", float8_all_gather=gather)
    fp8 = Simulator(sim.traced, sim.fabric, sim.compute, opts, backend=sim.backend, host=sim.host)
    if not fp8.compute.meta.get("float8_modules"):
        return ("float8: off (opt-in); it would gain nothing here: no linear passes TorchTitan's float8 filter "
                "(both dimensions divisible by 16, not the output head, not too small for torchao's auto filter)")
    est = fp8.simulate(plan)
    what = "tensorwise float8" + (" with the float8 all-gather" if gather else "")
    gain = (step_s - est.step_s) / step_s if step_s > 0 else 0.0
    fits = "" if sim.options.memory_budget_bytes is None or est.peak_bytes <= sim.options.memory_budget_bytes else (
        ", though over the memory budget")
    verb = f"would make this plan {gain:.0%} faster" if gain >= 0 else f"would make this plan {-gain:.0%} slower"
    return (f"float8: off (it changes numerics, so it is opt-in, as in TorchTitan); {what} {verb} "
            f"({est.step_s * 1e3:.2f} ms per step{fits}): --float8 auto searches it")
