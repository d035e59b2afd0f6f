"""memtrack.py outside spawned ranks (the user's own process, as under torchrun): the
profiler's "USDT ... profiler_start/stop" lines go to PROFILER_LOG, not to the terminal,
and what the process itself prints to stderr around them stays on it. Run in a fresh
interpreter, since Kineto reads its settings once per process."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys, torch
from wrapopt.evaluation.memtrack import LiveBytesTracker, PROFILER_LOG
m = torch.nn.Linear(8, 8)
print("before", file=sys.stderr, flush=True)
with LiveBytesTracker(m) as tracker:
    m(torch.randn(4, 8)).sum().backward()
print("after", file=sys.stderr, flush=True)
print(tracker.peak_bytes > 0, PROFILER_LOG)
"""


def test_profiler_lines_go_to_the_log_and_the_processs_own_stderr_stays(repo_root, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "WRAPOPT_SPAWNED_RANK")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=repo_root + os.pathsep + env.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", str(tmp_path / "wrapopt-profiler.log")]
    assert done.stderr.split() == ["before", "after"], done.stderr
    log = (tmp_path / "wrapopt-profiler.log").read_text()
    assert "profiler_start" in log and "profiler_stop" in log
