"""``wrapopt profile-fabric`` (cli/profile_fabric.py): the command spawns local gloo
ranks, writes the measured profile and prints its summary; bad arguments, an
unwritable output and a rank that dies are named before or instead of a file."""

from __future__ import annotations

import argparse
import os
import threading

import pytest

from wrapopt import launch
from wrapopt.cli import profile_fabric
from wrapopt.cli.profile_fabric import profile_fabric_main, run
from wrapopt.errors import DistributedError, ProfileError
from wrapopt.hardware.profiles import FabricProfile


# --- workers: module-level, so the 'spawn' start method can import them ----------------------


def _dying_worker(rank: int, world: int, kwargs: dict) -> dict | None:
    if rank == 1:  # dies mid-measurement, as an OOM-killed or crashed rank does
        threading.Timer(0.3, os._exit, (3,)).start()
    return profile_fabric._profile_worker(rank, world, kwargs)


@pytest.mark.multiprocess
def test_cli_profiles_with_spawned_ranks_and_prints_a_summary(tmp_path, capsys) -> None:
    parser = profile_fabric.add_parser(argparse.ArgumentParser().add_subparsers())
    out = tmp_path / "sub" / "fabric.json"
    args = parser.parse_args(["--out", str(out), "--sizes", "4KiB,64KiB", "--repeats", "3", "--no-overlap",
                              "--timeout", "60"])
    assert run(args) == 0
    fabric = FabricProfile.load(str(out))
    assert fabric.kind == "measured" and fabric.world_size == 2
    assert fabric.axes[0].curve("all_gather").sizes_bytes == (4096, 65536)
    printed = capsys.readouterr().out
    assert "MEASURED" in printed and "alpha us" in printed and f"wrote {out}" in printed
    assert "overlap: not measured" in printed


@pytest.mark.multiprocess
def test_tensor_parallel_groups_are_an_axis_of_their_own(tmp_path) -> None:
    parser = profile_fabric.add_parser(argparse.ArgumentParser().add_subparsers())
    out = tmp_path / "fabric.json"
    args = parser.parse_args(["--out", str(out), "--world-size", "4", "--sizes", "4KiB", "--repeats", "2",
                              "--no-overlap", "--timeout", "90", "--tp", "2", "--quiet"])
    assert run(args) == 0
    fabric = FabricProfile.load(str(out))
    axes = {a.name: (a.group_size, a.ranks_per_node_in_group) for a in fabric.axes}
    assert axes == {"sub2": (2, 2), "world": (4, 4)}
    t, caveat = fabric.collective_s("all_reduce", 2, 2, 4096)
    assert t > 0 and caveat is None  # measured, not rescaled from the world axis
    # gloo's all-gather allocates a copy of its output while it runs: See [Note: collective copies]
    assert 0.9 <= fabric.collective_copies <= 1.6
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "x.json", "--tp", "1"])


def test_cli_argument_errors() -> None:
    parser = profile_fabric.add_parser(argparse.ArgumentParser().add_subparsers())
    with pytest.raises(SystemExit):  # argparse: bad size, exit code 2 with a message
        parser.parse_args(["--out", "f.json", "--sizes", "4 parsecs"])
    args = parser.parse_args(["--out", "f.json", "--max-size", "1KiB"])
    with pytest.raises(ValueError, match="max-size"):
        run(args)


def test_unwritable_output_fails_before_measuring(monkeypatch) -> None:
    def no_spawn(*a, **k):
        raise AssertionError("ranks were spawned although the output cannot be written")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ProfileError, match="/proc/nope/f.json"):
        profile_fabric_main("/proc/nope/f.json")
    parser = profile_fabric.add_parser(argparse.ArgumentParser().add_subparsers())
    with pytest.raises(ProfileError, match="choose another --out"):
        run(parser.parse_args(["--out", "/proc/nope/f.json"]))


@pytest.mark.multiprocess
def test_a_rank_dying_mid_profile_is_named_and_no_file_is_written(tmp_path) -> None:
    out = tmp_path / "fabric.json"
    kwargs = dict(sizes_bytes=None, repeats=3, warmup=1, ranks_per_node=None, measure_overlap=True, progress=False)
    with pytest.raises(DistributedError, match="rank 1"):
        profile_fabric._measure_spawned(str(out), worker=_dying_worker, world_size=2, timeout_s=60, kwargs=kwargs)
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, sizes", [
    (["--world-size", "4", "--pp", "2"], (2,)),
    (["--world-size", "4", "--pp", "auto", "--tp", "4"], (2, 4)),
    (["--world-size", "8", "--ranks-per-node", "4", "--pp", "2"], ()),  # stages are nodes
    (["--world-size", "4"], ()),
])
def test_pp_asks_for_the_stage_groups(argv, sizes, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    parser = profile_fabric.add_parser(argparse.ArgumentParser().add_subparsers())
    assert profile_fabric.group_sizes(parser.parse_args(["--out", "f.json", *argv])) == sizes
