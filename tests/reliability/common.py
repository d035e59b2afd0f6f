"""What every case of the reliability suite asserts, whatever the entry point: one line,
naming what was wrong, and no traceback.

A case is (what is given, the exit code or error class, fragments of the one line). The CLI
runs in-process (``wrapopt.cli.main``); argparse's refusals exit 2 (its convention for usage
errors), wrapopt's own errors exit 1 (See wrapopt/cli/main.py).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from wrapopt.cli.main import main
from wrapopt.errors import WrapoptError

# argparse refused the value (usage error); wrapopt refused it (its own error)
USAGE, ERROR = 2, 1


def case(given: Any, code: Any, *fragments: str, id: str) -> Any:  # noqa: A002 (pytest's word)
    """One row of a table: ``given`` (argv, a file's change, a call), ``code`` (exit code or
    error class) and the fragments the one line must hold."""
    return pytest.param(given, code, fragments, id=id)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``wrapopt ARGV`` in-process: (exit code, stderr); argparse's exits count as codes."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: usage errors and --help
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def assert_cli_refuses(argv: list[str], code: int, fragments: tuple[str, ...],
                       capsys: pytest.CaptureFixture[str]) -> None:
    """Exit ``code``, one line on stderr starting with ``wrapopt COMMAND: error:``, holding every fragment."""
    got, err = run_cli(argv, capsys)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert got == code and len(lines) == 1, f"exit {got}, stderr:\n{err}"
    assert lines[0].startswith(f"wrapopt {argv[0]}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in: {lines[0]}"


def assert_api_refuses(call: Callable[[], Any], error: type[Exception], fragments: tuple[str, ...]) -> None:
    """``call()`` raises ``error`` (a ``WrapoptError``) whose message is one line holding every fragment."""
    assert issubclass(error, WrapoptError)
    with pytest.raises(error) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in: {msg}"
