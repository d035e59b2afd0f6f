"""What the commands print and draw: ``-v`` before or after the sub-command, and
``wrapopt search --plot DIR`` writing the two pictures offline."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.report.test_plots import png_size
from wrapopt.cli.logs import rank_log_dir
from wrapopt.cli.main import build_parser, main


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv, verbose", [(["demo"], False), (["-v", "demo"], True), (["demo", "-v"], True),
                                           (["--verbose", "bench", "zoo:gpt-tiny"], True),
                                           (["profile-fabric", "--out", "f.json", "--verbose"], True)])
def test_verbose_before_or_after_the_sub_command(argv, verbose):
    args = build_parser().parse_args(argv)
    assert args.verbose is verbose
    assert rank_log_dir(args, "results/demo") == (None if verbose else "results/demo/logs")


def test_search_plot_writes_both_pictures(tmp_path):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "plots"
    rc, out, err = _run(["search", "zoo:gpt-tiny", "--world-size", "2", "--trials", "20", "--memory", "12MiB",
                         "--no-progress", "--plot", str(folder)])
    assert rc == 0, err
    assert f"wrote {folder / 'timeline.png'}, {folder / 'pareto.png'}" in out
    for name in ("timeline.png", "pareto.png"):
        width, height = png_size(folder / name)
        assert width >= 800 and height >= 400
