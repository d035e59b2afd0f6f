"""``make demo`` leaves the tree clean: it writes a folder git ignores, and the committed
``results/demo/`` stays the recorded run."""

from __future__ import annotations

import os
import re
import subprocess

from wrapopt.cli.main import build_parser
from wrapopt.evaluation.demo import DEMO_OUT_DIR, run_demo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ignored(path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def test_demo_writes_to_an_ignored_folder_by_default():
    assert build_parser().parse_args(["demo"]).out == DEMO_OUT_DIR
    assert run_demo.__kwdefaults__["out_dir"] == DEMO_OUT_DIR
    assert _ignored(os.path.join(DEMO_OUT_DIR, "report.md"))
    assert not _ignored("results/demo/report.md")  # the recorded run stays tracked


def test_make_demo_writes_the_ignored_folder():
    with open(os.path.join(ROOT, "Makefile")) as f:
        line = next(ln for ln in f if "wrapopt.cli demo" in ln)
    out = re.search(r"--out (\S+)", line)
    assert out is None or _ignored(os.path.join(out.group(1), "report.md")), line
