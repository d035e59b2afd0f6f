"""Note citations that cannot rot.

Long reasoning lives once, in a named note that starts a paragraph or a
comment (``[Note: unit ownership] fully_shard runs bottom-up ...``), and code
elsewhere points to it as ``[Note: unit ownership] in wrapopt/units.py``. This
test reads every such citation in the repository's sources and documents and
fails naming each one whose file does not exist or does not define the note.

A cited path is read relative to the repository root, to the package
(``units.py`` is ``wrapopt/units.py``, as ``house_check.py`` reads it) or to the
citing file's folder; a citation may wrap across comment or docstring lines.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where citations are read: the package, its tests, benchmarks, scripts, docs and examples.
SCANNED = ("wrapopt", "tests", "benchmarks", "scripts", "docs", "examples", "README.md", "pyproject.toml")
SUFFIXES = (".py", ".md", ".toml")

# `[Note: X] in <path>`: the name, the word "in" and the path may each wrap onto a new comment
# line (`# ` continues a comment); the note and the path may sit in backquotes.
_GAP = r"(?:\s|#)+"
CITATION = re.compile(r"\[Note: ([^\]]+)\]`*" + _GAP + r"in" + _GAP + r"`*([\w./-]+\.(?:py|md|toml))\b")
# A definition is a mention that is neither a citation nor a pointer ("see [Note: X]",
# "[Note: X] and [Note: Y]"): the note's name opens the reasoning, mid-paragraph or at a line's start.
MENTION = re.compile(r"\[Note: ([^\]]+)\](`*" + _GAP + r"in" + _GAP + r"`*[\w./-]+\.(?:py|md|toml)\b)?")
POINTER = re.compile(r"(?:\b(?:see|and|or)|,)[\s#(`]*$", re.IGNORECASE)


def _name(raw: str) -> str:
    """A note's name with a wrap (newline, indentation, comment marks) read as one space."""
    return " ".join(raw.replace("#", " ").split())


def _files() -> list[Path]:
    out = []
    for entry in SCANNED:
        path = ROOT / entry
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            out += sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
    return out


def defined_notes(path: Path) -> set[str]:
    """The notes ``path`` defines."""
    text = path.read_text(errors="replace")
    return {_name(m.group(1)) for m in MENTION.finditer(text)
            if not m.group(2) and not POINTER.search(text, max(0, m.start() - 12), m.start())}


def citations(path: Path) -> list[tuple[int, str, str]]:
    """(line, note, cited path) of every citation in ``path``."""
    text = path.read_text(errors="replace")
    return [(text.count("\n", 0, m.start()) + 1, _name(m.group(1)), m.group(2)) for m in CITATION.finditer(text)]


def broken_citations() -> list[str]:
    cache: dict[Path, set[str]] = {}
    problems = []
    for path in _files():
        for line, note, cited in citations(path):
            candidates = [ROOT / cited, ROOT / "wrapopt" / cited, path.parent / cited]
            found = [c for c in candidates if c.is_file()]
            if not found:
                problems.append(f"{path.relative_to(ROOT)}:{line}: [Note: {note}] in {cited}: no such file")
                continue
            found = list(dict.fromkeys(c.resolve() for c in found))
            if not any(note in cache.setdefault(c, defined_notes(c)) for c in found):
                where = ", ".join(str(c.relative_to(ROOT)) for c in found)
                problems.append(f"{path.relative_to(ROOT)}:{line}: [Note: {note}] in {cited}: {where} does not define "
                                "it (cite the file that starts a paragraph or comment with the note)")
    return problems


def test_the_scan_finds_citations_and_definitions():
    units = ROOT / "wrapopt" / "units.py"
    assert "unit ownership" in defined_notes(units)
    assert sum(len(citations(p)) for p in _files()) > 20


def test_a_pointer_or_a_citation_is_not_a_definition(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("# [Note: alpha] The reasoning.\n# See [Note: beta] and [Note: gamma].\n"
                 "# Also [Note: delta]" " in wrapopt/units.py.\n")  # split: this file is scanned too
    assert defined_notes(f) == {"alpha"}


def test_a_citation_may_wrap_across_comment_lines(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("x = 1\n# See [Note: unit\n#   ownership] in\n# ``wrapopt/units.py``.\n")
    assert citations(f) == [(2, "unit ownership", "wrapopt/units.py")]


def test_every_note_citation_names_a_file_that_defines_the_note():
    problems = broken_citations()
    assert not problems, f"{len(problems)} broken note citation(s):\n  " + "\n  ".join(problems)
