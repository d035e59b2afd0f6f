"""fileio.py: ``parse_bytes``, the byte-size parser used for memory budgets."""

from __future__ import annotations

import pytest

from wrapopt.fileio import parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("80 gib", 80 * 2**30),
        ("85899345920", 85_899_345_920),
        (1024, 1024),
        ("1.5KiB", 1536),
        ("512MiB", 512 * 2**20),
        ("  2TB ", 2 * 10**12),
        ("100b", 100),
        ("80G", 80 * 2**30),  # one letter: powers of two, as Slurm's --mem reads it
        ("512m", 512 * 2**20),
    ],
)
def test_parse_bytes_accepts(text, expected):
    value = parse_bytes(text)
    assert value == expected and isinstance(value, int)


@pytest.mark.parametrize("text", ["lots", "-5GB", "", "80 GiBs", "0", "0GB", "GB", -1, 0, "80 XB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["0.5", 0.4])
def test_parse_bytes_never_returns_zero(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_write_between_replaces_only_its_own_section(tmp_path):
    from wrapopt.fileio import write_between

    path = tmp_path / "search.md"
    begin, end = "<!-- a: begin -->", "<!-- a: end -->"
    write_between(path, f"{begin}\nfirst\n{end}", begin, end)  # no file yet: appended
    path.write_text("# head\n\n" + path.read_text().lstrip() + "\nhand-written tail\n")
    write_between(path, f"{begin}\nsecond\n{end}", begin, end)
    text = path.read_text()
    assert "first" not in text and "second" in text
    assert text.startswith("# head") and text.endswith("hand-written tail\n")
    assert text.count(begin) == 1 and text.count(end) == 1
    with pytest.raises(ValueError, match="must start with"):
        write_between(path, "no markers", begin, end)
