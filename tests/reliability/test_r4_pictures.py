"""Issue #51: ``wrapopt search --plot DIR`` wrote through a symlink at ``DIR/timeline.png`` (``--out``
replaced the link). The pictures are now written by atomic replace (``fileio.atomic_write_bytes``):
a link where a picture goes is replaced by the picture, and whatever it pointed at is left alone,
whether it exists or not. ``wrapopt show --timeline`` writes the same way."""

from __future__ import annotations

import pytest

from tests.reliability.common import run_cli

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_and_show_timeline_replace_links_never_write_through_them(tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious.txt"
    victim.write_text("not a picture\n")
    dangling = outside / "created-through-the-link.png"
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "timeline.png").symlink_to(dangling)  # a link to nothing: must not create its target
    (plots / "pareto.png").symlink_to(victim)  # a link to a file: must not overwrite it
    plan = tmp_path / "plan.json"
    code, err = run_cli(["search", "zoo:gpt-tiny", "--world-size", "2", "--trials", "0", "--memory", "12MiB",
                         "--no-progress", "--out", str(plan), "--plot", str(plots)], capsys)
    assert code == 0, err
    for name in ("timeline.png", "pareto.png"):
        path = plots / name
        assert not path.is_symlink() and path.read_bytes()[:8] == PNG, name
    assert victim.read_text() == "not a picture\n" and not dangling.exists()

    link = tmp_path / "show.png"
    link.symlink_to(victim)
    code, err = run_cli(["show", str(plan), "--timeline", str(link)], capsys)
    assert code == 0, err
    assert not link.is_symlink() and link.read_bytes()[:8] == PNG
    assert victim.read_text() == "not a picture\n"
    assert not [p.name for p in plots.iterdir() if p.name.startswith(".tmp-")]  # no temporary file left
