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


def test_search_plot_draws_the_tables_numbers_under_bf16_and_accumulation(tmp_path, monkeypatch):
    # One simulation feeds the text, the JSON and the pictures: the objects handed to the
    # drawing functions carry the plan's predicted step and peak, with precision and accumulation.
    pytest.importorskip("matplotlib")
    import json

    import wrapopt.evaluation.pictures as pictures

    drawn: dict = {}
    monkeypatch.setattr(pictures, "draw_timelines", lambda panels, path, **kw: drawn.update(panels=panels, **kw))
    monkeypatch.setattr(pictures, "draw_pareto", lambda points, path, **kw: drawn.update(points=points))
    rc, out, err = _run(["search", "zoo:gpt-tiny", "--world-size", "2", "--trials", "0", "--memory", "12MiB",
                         "--precision", "bf16", "--accumulation", "4", "--no-progress", "--json",
                         "--plot", str(tmp_path)])
    assert rc == 0, err
    data = json.loads(out)
    pred = data["prediction"]
    chosen = drawn["panels"][0]
    assert (chosen.step_s, chosen.peak_bytes) == (pred["step_s"], pred["peak_bytes"])  # the timeline's title
    star = [p for p in drawn["points"] if p.role == "chosen"]
    assert len(star) == 1 and (star[0].step_s, star[0].peak_bytes) == (pred["step_s"], pred["peak_bytes"])
    assert star[0].peak_bytes <= drawn["budget_bytes"] == data["search"]["memory_budget"]
    # The simulator records one micro-batch: the drawing is told it is one of 4, not "the step".
    assert chosen.micro_batches == 4 and max(e[4] for e in chosen.events) < chosen.step_s
