"""wrapopt/progress.py: plain lines off a terminal, one overwritten line on a terminal
without tqdm, tqdm's bar on one with it, nothing when disabled; ``say`` writes to the
console that ``set_console`` chose."""

from __future__ import annotations

import fcntl
import io
import math
import os
import select
import struct
import sys
import termios

import pytest

from wrapopt import progress
from wrapopt.progress import Progress, say, set_console


class _FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_the_console_is_not_a_terminal():
    out = io.StringIO()
    with Progress(5, desc="bench", unit="round", stream=out, every_s=0.0) as bar:
        assert bar.mode == "plain"
        for k in range(5):
            bar.update(note=f"fastest {k} ms")
    text = out.getvalue()
    assert "\r" not in text and "\033" not in text
    lines = text.splitlines()
    assert lines[:2] == ["bench: 1/5 rounds, fastest 0 ms", "bench: 2/5 rounds, fastest 1 ms"]
    assert lines[-1].startswith("bench: 5/5 rounds, fastest 4 ms in ") and lines[-1].endswith(" s")
    assert len(lines) == 5  # a line per step before the last (every_s=0), then the closing line


def test_plain_mode_writes_only_the_closing_line_within_its_interval():
    out = io.StringIO()
    bar = Progress(200, desc="search", unit="trial", stream=out, every_s=math.inf)
    for k in range(200):
        bar.set(k + 1, note="best fitting 0.77 ms")
    bar.close()
    bar.close()  # closing twice writes nothing more
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("search: 200/200 trials, best fitting 0.77 ms in ")


def test_close_can_replace_or_drop_the_note():
    out = io.StringIO()
    bar = Progress(2, desc="profile fabric", unit="message size", stream=out, every_s=math.inf)
    bar.update(2, note="world all_reduce 4 MiB")
    bar.close(note="")
    assert out.getvalue().startswith("profile fabric: 2/2 message sizes in ")


def test_disabled_shows_nothing():
    out = _FakeTty()
    bar = Progress(3, desc="bench", stream=out, enabled=False)
    bar.update()
    bar.close()
    assert bar.mode == "off" and out.getvalue() == ""


def test_one_overwritten_line_on_a_terminal_that_gives_no_width():
    out = _FakeTty()  # isatty, but no file descriptor to ask for the width: tqdm would draw nothing
    with Progress(2, desc="search", unit="trial", stream=out) as bar:
        assert bar.mode == "line"
        bar.update(note="nothing fits yet")
        bar.update(note="best fitting 1.00 ms")
    text = out.getvalue()
    assert text.startswith("\rsearch: 1/2 trials, nothing fits yet") and text.endswith("\n")
    assert "\rsearch: 2/2 trials, best fitting 1.00 ms" in text


@pytest.fixture
def terminal():
    """A pseudo-terminal 100 columns wide, as a text stream (its other end is drained by the test)."""
    main, sub = os.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    stream = os.fdopen(sub, "w", buffering=1)
    yield stream, main
    stream.close()
    os.close(main)


def test_tqdm_on_a_terminal_and_one_line_without_it(terminal, monkeypatch):
    pytest.importorskip("tqdm")
    stream, main = terminal
    bar = Progress(3, desc="bench", unit="round", stream=stream)
    assert bar.mode == "tqdm"
    bar.update(3)
    bar.close()
    drawn = ""
    while select.select([main], [], [], 1.0)[0]:  # read everything written so far (it comes in chunks)
        drawn += os.read(main, 65536).decode(errors="replace")
        if "3/3" in drawn:
            break
    assert "bench" in drawn and "3/3" in drawn
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the extra not installed: import fails
    bar = Progress(3, desc="bench", unit="round", stream=stream)
    assert bar.mode == "line"
    bar.close()


def test_say_writes_to_the_console_set(capsys):
    out = io.StringIO()
    set_console(out)
    try:
        say("[1/5] measuring")
        assert progress.console() is out
    finally:
        set_console(None)
    assert out.getvalue() == "[1/5] measuring\n"
    say("back on stderr")
    assert capsys.readouterr().err == "back on stderr\n"
