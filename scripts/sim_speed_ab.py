"""Paired speed of two versions of the simulator: CPU time of the same workload, old vs new.

Each version runs in its own long-lived worker process (``PYTHONPATH`` = its
checkout), compiled and as Python (``WRAPOPT_JIT=0``), plus a second worker of
the new version for an A/A row (the noise between two processes of the same
code). Every round, each worker in turn (the order rotates) scores the same
workload with a fresh ``Simulator`` and reports the CPU time it took
(``time.process_time``: the machine is shared, wall time is not comparable);
the workloads are those of ``benchmarks/sim_speed.py`` (zoo:llama-7b, 64
ranks): a per-block and the size-1e8 plan again and again (layout cached),
random groupings of 1-4 blocks and random Optuna-space plans (a new layout
every call). Each worker also returns a digest of its estimates: the two
versions must score the same plans to the same numbers, else this stops.

Reported per kind: the median of the per-round ratios new/old (> 1: new is
faster, in plans per CPU second) with a bootstrap 95% interval of that
median, and the same for new/new' (A/A).

    git worktree add /tmp/wrapopt-old <commit>
    python scripts/sim_speed_ab.py --old /tmp/wrapopt-old [--rounds 20] [--out results/sim_speed_ab.md]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MESH = dict(world_size=64, ranks_per_node=8, shard_size=64)
KINDS = ("per-block", "size-1e8", "groupings", "optuna")
# plans per measurement, compiled and Python: ~50-150 ms of CPU each
SIZES = {"compiled": {"per-block": 3000, "size-1e8": 3000, "groupings": 900, "optuna": 300},
         "python": {"per-block": 900, "size-1e8": 900, "groupings": 450, "optuna": 100}}


class _Random:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def cat(self, name, choices):  # noqa: ANN001
        return self.rng.choice(choices)


def _worker(loop: str) -> int:
    """Answer 'kind round' lines on stdin with 'cpu_seconds digest' on stdout."""
    from wrapopt.cost import Simulator
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric
    from wrapopt.models import zoo
    from wrapopt.search.baselines import baselines
    from wrapopt.search.study.space import SearchSpace
    from wrapopt.spec import MeshSpec, PlanSpec, UnitSpec
    from wrapopt.trace.meta import trace_model

    entry = zoo.get_entry("llama-7b")
    graph = trace_model(entry.build("meta"), entry.inputs(), loss_fn=entry.loss, fx=False)
    mesh = MeshSpec(**MESH)
    base = baselines(graph, mesh)
    root, blocks = base["root-only"].units[-1], graph.blocks
    space = SearchSpace(graph, mesh)
    fabric, compute = analytical_fabric(world_size=MESH["world_size"]), analytical_compute()

    def plans(kind: str, k: int) -> list:
        size = SIZES[loop][kind]
        if kind in ("per-block", "size-1e8"):
            return [base[kind]] * size
        if kind == "groupings":
            rng, out = random.Random(k), []
            for _ in range(size):
                groups, i = [], 0
                while i < len(blocks):
                    n = rng.randint(1, 4)
                    groups.append(UnitSpec(blocks[i:i + n], rng.random() < 0.5, rng.random() < 0.3))
                    i += n
                out.append(PlanSpec(tuple(groups) + (root,), mesh))
            return out
        src = _Random(random.Random(100 + k))
        return [space.decode(src) for _ in range(size)]

    Simulator(graph, fabric, compute).simulate(base["per-block"])  # load the compiled code
    print("ready", flush=True)
    for line in sys.stdin:
        kind, k = line.split()
        work = plans(kind, int(k))
        sim = Simulator(graph, fabric, compute)
        gc.collect()
        t0 = time.process_time()
        ests = [sim.simulate(p) for p in work]
        cpu = time.process_time() - t0
        digest = hashlib.sha256(repr([(e.step_s, e.peak_bytes, e.comm_s) for e in ests]).encode()).hexdigest()[:16]
        print(f"{cpu!r} {digest}", flush=True)
    return 0


class _Proc:
    def __init__(self, root: str, loop: str):
        # One hash seed for every worker: string hashes (dict and set layouts) alike in all of them,
        # else the A/A row shows ~5-10% between two processes of the same code as Python.
        env = {**os.environ, "PYTHONPATH": root, "WRAPOPT_JIT": "1" if loop == "compiled" else "0",
               "PYTHONHASHSEED": "0"}
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", loop], cwd=root, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        line = self.p.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"sim_speed_ab: a worker failed to start (got {line!r}); see its stderr above")

    def run(self, kind: str, k: int) -> tuple[float, str]:
        self.p.stdin.write(f"{kind} {k}\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit("sim_speed_ab: a worker died; see its stderr above")
        cpu, digest = line.split()
        return float(cpu), digest

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def _interval(ratios: list[float], rng: random.Random, n: int = 2000) -> tuple[float, float]:
    """Bootstrap 95% interval of the median of ``ratios``."""
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="root of the old checkout (PYTHONPATH for the old workers)")
    ap.add_argument("--new", default=ROOT)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--loops", default="compiled,python", help="compiled, python or both")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--out", help="also write the tables, with the machine and the command, to this markdown file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args.worker)
    if not args.old:
        ap.error("--old is required")
    kinds = args.kinds.split(",")
    rng = random.Random(0)
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
    for loop in args.loops.split(","):
        procs = {"old": _Proc(os.path.abspath(args.old), loop), "new": _Proc(os.path.abspath(args.new), loop),
                 "new'": _Proc(os.path.abspath(args.new), loop)}
        for p in procs.values():
            p.wait_ready()
        cpu: dict[tuple[str, str], list[float]] = {(w, kd): [] for w in procs for kd in kinds}
        names = list(procs)
        for r in range(args.rounds):
            for kind in kinds:
                order = names[r % 3:] + names[:r % 3]  # rotate who goes first
                digests = set()
                for w in order:
                    t, d = procs[w].run(kind, r)
                    cpu[(w, kind)].append(t)
                    digests.add(d)
                if len(digests) != 1:
                    raise SystemExit(f"sim_speed_ab: {kind} round {r}: the versions' estimates differ ({digests})")
        for p in procs.values():
            p.close()
        say("")
        say(f"{loop}: {args.rounds} rounds; CPU ms per measurement (median); ratio of plans per CPU second, "
            "median of the rounds [bootstrap 95%]")
        say("")
        say("| kind | plans per measurement | old ms | new ms | new/old | A/A new/new' |")
        say("|---|---|---|---|---|---|")
        for kind in kinds:
            old, new, new2 = cpu[("old", kind)], cpu[("new", kind)], cpu[("new'", kind)]
            ab = [o / n for o, n in zip(old, new)]
            aa = [b / a for a, b in zip(new, new2)]
            lo, hi = _interval(ab, rng)
            alo, ahi = _interval(aa, rng)
            say(f"| {kind} | {SIZES[loop][kind]} | {statistics.median(old) * 1e3:.1f} | "
                f"{statistics.median(new) * 1e3:.1f} | {statistics.median(ab):.3f} [{lo:.3f}, {hi:.3f}] | "
                f"{statistics.median(aa):.3f} [{alo:.3f}, {ahi:.3f}] |")
    if args.out:
        sys.path.insert(0, ROOT)
        import platform

        from wrapopt.fileio import atomic_write_text

        def head(root: str) -> str:
            out = subprocess.run(["git", "-C", root, "log", "-1", "--format=%h %s"], capture_output=True, text=True)
            return out.stdout.strip()[:100] or root

        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        text = [
            "# Simulator speed: two versions in paired CPU time",
            "",
            f"Machine: {platform.node()}, {os.cpu_count()} cores ({platform.machine()}); Python "
            f"{platform.python_version()}; {date}; {time.perf_counter() - t_start:.0f} s. Load average (1 min) before "
            f"and after: {load0:.1f} and {os.getloadavg()[0]:.1f} (the machine is shared with other processes when "
            f"above 1: CPU time, paired rounds and the A/A row are for that).",
            "",
            f"old: `{head(os.path.abspath(args.old))}`; new: `{head(os.path.abspath(args.new))}` (working tree). "
            f"Regenerate: `python scripts/sim_speed_ab.py --old <checkout of old> --rounds {args.rounds} --out ...`. "
            "Workloads as `benchmarks/sim_speed.py` (zoo:llama-7b, 64 ranks, analytical fabric): per-block and "
            "size-1e8 scored again and again (layout cached), random groupings of 1-4 blocks and random Optuna-space "
            "plans (a new layout each); a fresh `Simulator` per measurement; both versions' estimates checked equal.",
            *lines,
            "",
        ]
        atomic_write_text(args.out, "\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
