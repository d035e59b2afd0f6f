"""``wrapopt --help``, every ``wrapopt CMD --help`` and an argument error load no torch
(See [Note: first contact] in wrapopt/cli/main.py). Checked in a fresh interpreter, where
nothing has imported torch yet; how long it takes is measured by hand, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = r"""
import contextlib, io, json, sys

import wrapopt
import wrapopt.interop
from wrapopt.cli.main import build_parser, main

seen = {"import wrapopt, wrapopt.interop.TARGETS": ("torch" in sys.modules, None)}
assert wrapopt.interop.TARGETS
commands = list(next(a for a in build_parser()._actions if a.dest == "command").choices)
runs = [["--help"], *([c, "--help"] for c in commands), [],
        ["search", "zoo:gpt-tiny", "--world-size", "0"], ["export", "plan.json", "--to", "nowhere"],
        ["profile-fabric", "--out", "f.json", "--sizes", "lots"], ["estimate", "zoo:gpt-tiny", "--pp", "x"]]
for argv in runs:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    seen[" ".join(["wrapopt", *argv])] = ("torch" in sys.modules, code)
print(json.dumps({"commands": commands, "seen": seen}))
"""


def test_help_and_argument_errors_load_no_torch():
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"search", "export", "estimate", "profile-fabric", "bench"} <= set(report["commands"])
    loaded = [what for what, (torch, _) in report["seen"].items() if torch]
    assert not loaded, f"these imported torch (the first one did it): {loaded}"
    codes = {what: code for what, (_, code) in report["seen"].items()}
    assert codes["wrapopt --help"] == 0 and codes["wrapopt export --help"] == 0
    assert codes["wrapopt search zoo:gpt-tiny --world-size 0"] == 2  # argparse's refusal, not a run
    assert codes["wrapopt"] == 2  # no command given


def test_old_import_paths_and_lazy_names():
    """The root package resolves its public names and the old module paths on use."""
    probe = ("import sys, wrapopt; before = 'torch' in sys.modules; "
             "from wrapopt import optimize_wrap, zoo, WrapPlan, TrainConfig; import wrapopt.types, wrapopt.apply; "
             "from wrapopt.fabric import FabricProfile; import wrapopt.plan.apply as a, wrapopt.spec as s; "
             "import json; print(json.dumps([before, wrapopt.types is s, wrapopt.apply is a, a.__spec__.name, "
             "FabricProfile is wrapopt.FabricProfile, zoo.__name__, "
             "sorted(set(wrapopt.__all__) - set(dir(wrapopt))), "
             "[m for m in ('torch.distributed.pipelining', 'torch.distributed.fsdp', 'torch._dynamo') "
             "if m in sys.modules]]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, types_ok, apply_ok, spec_name, fabric_ok, zoo_name, missing, heavy = json.loads(done.stdout.strip())
    # what only a pipeline, an FSDP1 export or compile needs is imported when used: a second per process
    # (See [Note: torch's schedules read late] in wrapopt/cost/pipeline_schedule.py, [Note: FSDP1 imported late])
    assert heavy == []
    assert before is False  # `import wrapopt` alone loads no torch
    assert types_ok and apply_ok and fabric_ok and spec_name == "wrapopt.plan.apply"
    assert zoo_name == "wrapopt.models.zoo" and missing == []
