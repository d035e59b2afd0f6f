"""memtrack.py outside spawned ranks (the user's own process, as under torchrun): the
profiler's "USDT ... profiler_start/stop" lines go to profiler_log_path(), not to the
terminal, and what the process itself prints to stderr around them stays on it. The log
lives in a private per-process directory: a file or symlink planted at a fixed name in the
temporary directory is never written (issue 33). Run in a fresh interpreter, since Kineto
reads its settings once per process."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

SCRIPT = """
import sys, torch
from wrapopt.evaluation.memtrack import LiveBytesTracker, profiler_log_path
m = torch.nn.Linear(8, 8)
print("before", file=sys.stderr, flush=True)
with LiveBytesTracker(m) as tracker:
    m(torch.randn(4, 8)).sum().backward()
print("after", file=sys.stderr, flush=True)
print(tracker.peak_bytes > 0, profiler_log_path())
"""


def test_profiler_lines_go_to_a_private_log_and_the_processs_own_stderr_stays(repo_root, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    (tmp_path / "wrapopt-profiler.log").symlink_to(victim)  # the old fixed name, planted by someone else
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "WRAPOPT_SPAWNED_RANK")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=repo_root + os.pathsep + env.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ok, path = done.stdout.split()
    assert ok == "True"
    assert done.stderr.split() == ["before", "after"], done.stderr
    assert victim.read_text() == "keep\n"
    log_dir = os.path.dirname(path)
    assert os.path.dirname(log_dir) == str(tmp_path) and log_dir != str(tmp_path)
    assert stat.S_IMODE(os.stat(log_dir).st_mode) == 0o700 and not os.path.islink(path)
    log = open(path).read()
    assert "profiler_start" in log and "profiler_stop" in log
