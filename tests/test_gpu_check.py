"""benchmarks/gpu_check.py runs end to end on the CPU (--device cpu): the code path the GPU run takes.

One repeat of each step and of each compute-profile measurement (``--profile-repeats 1``: the profile's
five repeats took nine tenths of this test's time): what is checked is the code path and the report's
shape, not the figures."""

from __future__ import annotations

import pytest

from benchmarks import gpu_check


@pytest.mark.multiprocess
def test_gpu_check_on_cpu(tmp_path):
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--repeats", "1", "--profile-repeats", "1"]) == 0
    text = out.read_text()
    assert text.startswith("# GPU check: ")
    rows = [line for line in text.splitlines() if line.startswith("| per-block") or line.startswith("| root-only")
            or line.startswith("| size-1e8")]
    assert len(rows) >= 6
    assert (sum("bf16" in r for r in rows) >= 6 and any("ckpt" in r for r in rows)
            and any("4 micro-batches" in r for r in rows))
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        pred_ms, meas_ms = float(cells[3]), float(cells[4])
        assert pred_ms > 0 and meas_ms > 0
        assert abs(float(cells[9].rstrip("%"))) < 25  # predicted vs measured peak, live bytes on CPU
    assert "slowest modules, bf16" in text
    gemms = [line for line in text.splitlines() if line.startswith("| 64 |") or line.startswith("| 128 |")]
    assert len(gemms) == 8 and all(float(g.strip("|").split("|")[4]) > 0 for g in gemms)  # 2 widths x 4 GEMMs
