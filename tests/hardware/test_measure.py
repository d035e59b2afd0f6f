"""hardware/measure_collectives.py and measure_device.py: fabric and compute profiles
measured on local gloo ranks, checked for shape, not speed.

Each spawn of ranks costs a few seconds, so every spawned worker below checks
several things at once. No assertion here is about wall time (see STYLE.md).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from wrapopt.errors import ModelError, ProfileError
from wrapopt.hardware.measure_collectives import measure_fabric
from wrapopt.hardware.measure_device import measure_compute, measure_module_times, measure_unit_overhead
from wrapopt.hardware.measure_fsdp import measure_byte_overhead, measure_param_overhead
from wrapopt.hardware.profiles import COLLECTIVES, CollectiveCurve, ComputeProfile, FabricProfile
from wrapopt.launch import spawn
from wrapopt.models import zoo
from wrapopt.report.fabric import format_fabric

SMALL_SIZES = [4 * 2**10, 64 * 2**10, 2**20]


# --- workers: module-level, so the 'spawn' start method can import them ----------------------


def _two_rank_worker(rank: int, world: int) -> dict:
    fabric = measure_fabric(sizes_bytes=SMALL_SIZES, repeats=3, progress=False, measure_overlap=True)
    unit_s = measure_unit_overhead(num_layers=4, repeats=2, warmup=1)
    param_s = measure_param_overhead(layers=(2, 16), repeats=2, warmup=1)
    byte_s = measure_byte_overhead(width=4096, repeats=2, warmup=1)
    return {"fabric": fabric.to_json(), "unit_overhead_s": unit_s, "param_overhead_s": param_s,
            "byte_overhead_s": byte_s}


def _two_by_two_worker(rank: int, world: int) -> dict:
    # ranks_per_node comes from LOCAL_WORLD_SIZE, as under torchrun.
    return measure_fabric(sizes_bytes=SMALL_SIZES[:2], collectives=("all_gather", "reduce_scatter"), repeats=3,
                          progress=False, measure_overlap=False).to_json()


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    return spawn(_two_rank_worker, world_size=2, timeout_s=120)


# --- measured fabric on 2 ranks ----------------------------------------------------------------


@pytest.mark.multiprocess
def test_every_rank_gets_the_same_measured_profile(two_rank_results: list[dict]) -> None:
    first, second = (r["fabric"] for r in two_rank_results)
    assert first == second  # latencies, meta and overlap factors alike
    fabric = FabricProfile.from_json(first)
    assert fabric.kind == "measured" and fabric.world_size == 2 and fabric.backend == "gloo"
    assert [(a.name, a.group_size, a.ranks_per_node_in_group) for a in fabric.axes] == [("world", 2, 2)]
    assert {n for n, _ in fabric.axes[0].curves} == set(COLLECTIVES)
    assert fabric.meta["hosts"] and fabric.meta["torch_version"] == torch.__version__
    assert fabric.meta["repeats"] == 3 and fabric.meta["dtype"] == "float32"
    assert fabric.overlap_compute_slowdown >= 0 and fabric.overlap_comm_slowdown >= 0
    assert math.isfinite(fabric.overlap_compute_slowdown) and math.isfinite(fabric.overlap_comm_slowdown)


@pytest.mark.multiprocess
def test_measured_curves_interpolate_monotonically(two_rank_results: list[dict]) -> None:
    fabric = FabricProfile.from_json(two_rank_results[0]["fabric"])
    for axis in fabric.axes:
        for name, curve in axis.curves:
            assert len(curve.sizes_bytes) == len(SMALL_SIZES) and len(curve.spread) == len(SMALL_SIZES)
            grid = [2 ** (k / 4) for k in range(4 * 10, 4 * 26)]  # 1 KiB .. 64 MiB, past both ends
            times = [curve.time_s(n)[0] for n in grid]
            assert all(t > 0 for t in times)
            assert all(b >= a for a, b in zip(times, times[1:])), f"{axis.name} {name} not monotone"
            # The cost model's entry point agrees with the curve on the measured group.
            t, caveat = fabric.collective_s(name, 2, 2, 2**19)
            assert t == curve.time_s(2**19)[0] and caveat is None
            assert 0 < curve.bandwidth_bytes_per_s < math.inf  # a finite bandwidth even if noisy


@pytest.mark.multiprocess
def test_measured_profile_json_round_trip(two_rank_results: list[dict], tmp_path) -> None:
    fabric = FabricProfile.from_json(two_rank_results[0]["fabric"])
    path = tmp_path / "fabric.json"
    fabric.save(str(path))
    again = FabricProfile.load(str(path))
    assert again == fabric and again.meta == fabric.meta
    assert again.collective_s("all_gather", 2, 2, 3e5) == fabric.collective_s("all_gather", 2, 2, 3e5)
    text = format_fabric(again)
    assert "MEASURED" in text.splitlines()[0] and "ANALYTICAL" not in text
    assert "axis world" in text and "1.00 MiB" in text and "reduce_scatter" in text


@pytest.mark.multiprocess
def test_unit_overhead_is_measured_under_a_group(two_rank_results: list[dict]) -> None:
    for key in ("unit_overhead_s", "param_overhead_s", "byte_overhead_s"):  # the notes in hardware/measure_fsdp.py
        values = [r[key] for r in two_rank_results]
        assert values[0] == values[1]  # max over ranks: the ranks agree
        assert 0 <= values[0] and math.isfinite(values[0])  # floored at 0; no speed is asserted


# --- layouts, failures ---------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_two_nodes_of_two_measure_intra_inter_and_world_separately() -> None:
    results = spawn(_two_by_two_worker, world_size=4, timeout_s=120, env={"LOCAL_WORLD_SIZE": "2"})
    assert all(r == results[0] for r in results)
    fabric = FabricProfile.from_json(results[0])
    layout = {a.name: (a.group_size, a.ranks_per_node_in_group) for a in fabric.axes}
    assert layout == {"intra": (2, 2), "inter": (2, 1), "world": (4, 2)}
    assert fabric.ranks_per_node == 2 and fabric.name == "gloo-2x2" and fabric.meta["simulated_nodes"] is True
    # Each axis answers for its own group; an unmeasured group gets a caveat.
    assert fabric.collective_s("all_gather", 2, 1, 2**16)[1] is None
    assert fabric.collective_s("all_gather", 4, 2, 2**16)[1] is None
    assert fabric.collective_s("all_gather", 8, 2, 2**16)[1] is not None
    text = format_fabric(fabric)
    assert "axis intra" in text and "axis inter" in text and "axis world" in text and "simulated" in text


def test_measure_fabric_needs_a_process_group() -> None:
    with pytest.raises(ProfileError, match="process group"):
        measure_fabric()


# --- compute -----------------------------------------------------------------------------------


def test_compute_profile_fields_are_positive_and_round_trip(tmp_path) -> None:
    prof = measure_compute(device="cpu", repeats=2)
    assert prof.kind == "measured" and prof.device == "cpu"
    assert prof.flops_per_s > 0 and prof.memory_bandwidth_bytes_per_s > 0
    assert prof.memory_capacity_bytes is not None and prof.memory_capacity_bytes > 2**20
    assert prof.module_overhead_s > 0
    assert prof.unit_overhead_s == 0.0 and "not measured" in prof.meta["unit_overhead"]  # no process group here
    path = tmp_path / "compute.json"
    prof.save(str(path))
    assert ComputeProfile.load(str(path)) == prof


def test_module_times_cover_every_module_of_gpt_tiny() -> None:
    entry = zoo.get_entry("gpt-tiny")
    model, inputs = zoo.build("gpt-tiny")
    prof = measure_compute(model=model, example_inputs=inputs, loss_fn=entry.loss, repeats=2)
    times = {fqn: (f, b) for fqn, f, b in prof.module_times}
    assert set(times) == {fqn for fqn, _ in model.named_modules()}  # root "" included
    assert all(f >= 0 and b >= 0 for f, b in times.values())
    # Modules that compute something got time; the never-called ModuleList container got none.
    for fqn in ("wte", "layers.0.attn", "layers.3.mlp.fc1", "lm_head", ""):
        assert times[fqn][0] > 0 and times[fqn][1] > 0, fqn
    assert times["layers"] == (0.0, 0.0)
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was given


class _Pausing(nn.Linear):
    """A linear layer that advances a synthetic clock by 1 s in its forward, and by 30 s more on the
    steps ``step[0] % 4 == turn`` (a pause)."""

    def __init__(self, turn: int, step: list[int], clock: list[float]) -> None:
        super().__init__(4, 4)
        self.turn, self.step, self.clock = turn, step, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock[0] += 1.0 + (30.0 if self.step[0] % 4 == self.turn else 0.0)
        return super().forward(x)


class _Paused(nn.Module):
    """Four ``_Pausing`` layers: every step's forward pauses once, in each layer one step in four."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.step = [0]
        self.layers = nn.ModuleList(_Pausing(i, self.step, clock) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        self.step[0] += 1
        return x


def test_module_times_add_up_to_the_whole_forward_when_each_call_pauses_now_and_then() -> None:
    # See [Note: measured module times]: each layer's median misses the pause, the whole forward does not.
    # On a synthetic clock: every step's forward takes 4 + 30 s, each layer's median is 1 s.
    clock = [0.0]
    model = _Paused(clock)
    times = {fqn: (f, b) for fqn, f, b in measure_module_times(model, (torch.ones(2, 4),), repeats=8, warmup=0,
                                                               clock=lambda: clock[0])}
    assert [times[f"layers.{i}"][0] for i in range(4)] == [34.0 / 4] * 4  # equal shares of the whole forward
    assert sum(f for f, _ in times.values()) == 34.0
    assert times[""] == (0.0, 0.0) and times["layers"] == (0.0, 0.0)  # no own ops; never called
    assert all(b == 0.0 for _, b in times.values())  # the backward advanced no clock


def test_module_times_need_real_weights() -> None:
    model = nn.Linear(4, 4, device="meta")
    with pytest.raises(ModelError, match="real weights"):
        measure_compute(model=model, example_inputs=(torch.ones(2, 4),))


def test_a_size_keeps_the_mean_of_its_repeats_and_the_spread_about_the_median() -> None:
    # See [Note: mean collective times]: a stall one time in five counts in the expected time
    from wrapopt.hardware.measure_collectives import _stats

    mean, spread = _stats(torch.tensor([1.0, 1.0, 1.0, 1.0, 6.0]))
    assert mean == pytest.approx(2.0)  # the median would say 1.0
    q10, q90 = 1.0, 1.0 + 0.6 * 5.0  # torch.quantile's linear interpolation at 0.1 and 0.9
    assert spread == pytest.approx((q90 - q10) / 1.0)


def test_a_latency_bound_curve_keeps_a_finite_bandwidth() -> None:
    # What the measured curves above rely on, on recorded latencies: no bandwidth term visible
    # (every size as fast) bounds the bandwidth by the largest size's time, never near-infinite.
    curve = CollectiveCurve(tuple(SMALL_SIZES), (1e-4, 1e-4, 1e-4))
    assert curve.bandwidth_bytes_per_s == pytest.approx(SMALL_SIZES[-1] / 1e-4)
    assert curve.time_s(2 * SMALL_SIZES[-1]) == (pytest.approx(2e-4), True)  # extrapolated at that bound
