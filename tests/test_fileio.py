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
