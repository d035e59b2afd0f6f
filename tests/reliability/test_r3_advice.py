"""Out-of-memory advice is computed, not listed (issue 51, search/remedies.py): each remedy is
priced on the plan of least memory, those that fit are printed with their flags, step and peak,
one already in place is never suggested, and when none fits the closest is named with how far
over it is. The flags printed are run back through ``wrapopt search``: they fit.

llama-tiny (meta, 6 blocks, 4 heads) on 8 ranks of the stated h100-sxm preset (its host link
prices CPU offload); budgets a few MiB, set from the plan of least memory's own peak."""

from __future__ import annotations

import re
import pytest

from tests.reliability.common import run_cli
from wrapopt.api import plan_model, prepare
from wrapopt.errors import InfeasibleError
from wrapopt.fileio import fmt_bytes
from wrapopt.hardware.host import host_for
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.search.driver import SearchOptions
from wrapopt.search import remedies
from wrapopt.search.remedies import Advice, find_remedies
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.trace.meta import trace_model
from wrapopt.train import TrainConfig

MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
FABRIC = analytical_fabric("h100+ib400", world_size=8, ranks_per_node=8)
HOST = host_for(FABRIC, host_memory_bytes=1, ranks_per_node=8)  # its link only: the advice says the memory
MiB = 2**20
CLI = ["search", "zoo:llama-tiny", "--world-size", "8", "--gpu", "h100-sxm", "--trials", "0"]


def _advice(llama_tiny, budget: float, *, graph=None, offload_host=HOST, **request) -> Advice:
    model, _x, g = llama_tiny
    g = graph or g
    job = prepare(ParallelRequest(mesh=MESH, memory_budget=budget, **request), model, graph=g, fabric=FABRIC,
                  compute=analytical_compute("h100"))
    # no time bound here (a loaded test machine must not cut a remedy): test_bounded_in_time tests it
    return find_remedies(g, job.sim, job.request, job.budget, offload_host=offload_host, time_limit_s=600)


def test_nothing_in_place_is_suggested(llama_tiny):
    """A micro-batch of one sequence, bf16 on, every block checkpointed, --tp auto and --pp auto:
    none of them comes back as a remedy; each is said to be in place."""
    model, x, _g = llama_tiny
    one = trace_model(model, (x[0][:1],), loss_fn=zoo.ZOO["llama-tiny"].loss)  # one sequence per rank
    assert one.batch_size == 1
    advice = _advice(llama_tiny, MiB, graph=one, train=TrainConfig.preset("bf16"), tp="auto", pp="auto")
    flags = " ".join(r.flag for r in advice.priced)
    for flag in ("--batch", "--precision", "--checkpoint-modes", "--tp", "--pp"):
        assert flag not in flags, advice.text()
    said = " ".join(advice.in_place)
    for what in ("one sequence per rank", "every block checkpointed", "bfloat16 (--precision bf16)", "--tp auto",
                 "--pp auto"):
        assert what in said, said
    # what was not in place was priced: a lighter optimizer, offload, a shorter sequence
    flags = [r.flag for r in advice.priced]
    assert "--optimizer adafactor" in flags and any(f.startswith("--seq ") for f in flags), advice.text()


def test_when_none_fits_the_closest_is_named_with_how_far_over(llama_tiny):
    advice = _advice(llama_tiny, MiB)
    assert advice.priced and not advice.fitting
    near = min(advice.priced, key=lambda r: r.peak_bytes)
    text = advice.text()
    assert ": fits," not in text
    assert (f"the closest is {near.flag}: {fmt_bytes(near.peak_bytes)}, {fmt_bytes(near.peak_bytes - MiB)} over "
            f"the budget of {fmt_bytes(MiB)}") in text
    # every remedy lowers something real: the least peak of all is below the plan's own
    assert near.peak_bytes < advice.base_peak_bytes


def test_when_none_fits_alone_a_pair_is_priced_together(llama_tiny):
    first = _advice(llama_tiny, MiB)
    closest = min(r.peak_bytes for r in first.priced)
    assert first.together is not None and first.together.peak_bytes < closest, first.text()
    budget = (first.together.peak_bytes + closest) / 2  # no remedy alone fits it; that pair does
    advice = _advice(llama_tiny, budget)
    assert not advice.fitting and advice.together is not None and advice.together.fits, advice.text()
    assert advice.together.peak_bytes <= budget
    assert f"  together, {advice.together.flag}: fits, {fmt_bytes(advice.together.peak_bytes)}, " in advice.text()


def test_what_fits_is_printed_with_its_step_and_peak(llama_tiny):
    base = _advice(llama_tiny, MiB).base_peak_bytes
    budget = 0.75 * base  # the plan of least memory is over it: nothing fits as asked
    advice = _advice(llama_tiny, budget)
    assert advice.fitting, advice.text()
    text = advice.text()
    for r in advice.fitting:
        assert r.peak_bytes <= budget
        line = next(x for x in text.splitlines() if x.startswith(f"  {r.flag}: fits, "))
        assert fmt_bytes(r.peak_bytes) in line and " ms per step" in line
    for r in advice.priced:
        if not r.fits:
            assert f"  {r.flag}: fits" not in text  # over the budget: not printed as a remedy
    # the remedies that train the same tokens come first, fastest first
    same = [r for r in advice.fitting if r.work == 1.0]
    assert [r.step_s for r in same] == sorted(r.step_s for r in same)
    assert list(advice.fitting[:len(same)]) == same


def test_the_printed_flags_fit_when_run(llama_tiny, capsys, monkeypatch):
    """``wrapopt search`` with a budget nothing fits prints the advice; the tensor-parallel and
    the pipeline remedies' flags, given back, find a plan that fits."""
    monkeypatch.setattr(remedies, "REMEDY_TIME_S", 600.0)  # a loaded test machine must not cut a remedy
    base = _advice(llama_tiny, MiB).base_peak_bytes
    memory = f"{base * 0.75 / MiB:.2f}MiB"
    code, err = run_cli([*CLI, "--memory", memory], capsys)
    lines = err.splitlines()
    assert code == 1 and lines[0].startswith("wrapopt search: error: no plan fits"), err
    assert "mixed precision" not in lines[0] and "smaller per-rank batch" not in lines[0]
    assert lines[1].startswith("Remedies, each alone on per-block,ckpt"), err
    fitting = [m.group(1) for m in (re.match(r"  (--\S.*?): fits, ", x) for x in lines[2:]) if m]
    picked = [f for f in fitting if f.startswith(("--tp", "--pp"))]
    assert len(picked) == 2, err
    for flags in picked:
        code, err = run_cli([*CLI, "--memory", memory, *flags.split()], capsys)
        assert code == 0, f"{flags}: {err}"


def test_offload_is_priced_on_a_stated_host_link_and_fits_when_asked(llama_tiny):
    model, _x, g = llama_tiny
    base = _advice(llama_tiny, MiB).base_peak_bytes
    budget = 0.97 * base
    unpriced = _advice(llama_tiny, budget, offload_host=None)
    assert not any(r.flag.startswith("--offload") for r in unpriced.priced)
    assert any(x.startswith("--offload:") and "--gpu" in x for x in unpriced.not_priced), unpriced.not_priced
    advice = _advice(llama_tiny, budget)
    off = next(r for r in advice.priced if r.flag.startswith("--offload"))
    assert off.fits and off.peak_bytes < base, advice.text()
    size = int(re.fullmatch(r"--offload --host-memory (\d+)GiB", off.flag).group(1)) * 2**30
    request = ParallelRequest(mesh=MESH, memory_budget=budget, offload=True, host_memory=size)
    job = prepare(request, model, graph=g, fabric=FABRIC, compute=analytical_compute("h100"))
    plan, result = plan_model(job, search=SearchOptions(trials=0))
    assert result.best.fits and plan.spec.offload
    plain = prepare(ParallelRequest(mesh=MESH, memory_budget=budget), model, graph=g, fabric=FABRIC,
                    compute=analytical_compute("h100"))
    with pytest.raises(InfeasibleError, match="Remedies, each alone"):  # without offload nothing fits
        plan_model(plain, search=SearchOptions(trials=0))


def test_bounded_in_time(llama_tiny):
    model, _x, g = llama_tiny
    job = prepare(ParallelRequest(mesh=MESH, memory_budget=MiB), model, graph=g, fabric=FABRIC,
                  compute=analytical_compute("h100"))
    advice = find_remedies(g, job.sim, job.request, job.budget, offload_host=HOST, time_limit_s=0)
    assert advice.priced == () and advice.num_simulated == 1  # the plan of least memory itself
    cut = [x for x in advice.not_priced if "not tried (past the 0 s bound)" in x]
    assert len(cut) >= 6, advice.not_priced  # micro-batch, step knobs, tp, pp, offload, sequence
    assert "none could be priced" in advice.text()
