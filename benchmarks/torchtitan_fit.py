"""The 500 W H100 preset's four fitted constants, on four named TorchTitan rows: ``python -m
benchmarks.torchtitan_fit``.

[Note: the TorchTitan fit] The fit set is four rows of pytorch/torchtitan
``benchmarks/llama3_h100_202412_torchtitan.md`` (Llama 3.1 8B, 8 H100 96 GB HBM2e at 500 W), each
described with ``wrapopt search --current`` exactly as ``benchmarks/torchtitan_rows.py`` and
``benchmarks/torchtitan_cp.py`` describe it, one constant named per row:

1. Table 1, FSDP (local batch 2, seq 8192, selective AC, eager): the GEMM fraction
   (``matmul_fraction``), since the 500 W rates are an interpolation (See [Note: the 500 W H100] in
   hardware/catalog.py) and the fraction absorbs what the interpolation misses;
2. Table 1, FSDP + torch.compile: ``compile_fraction`` ([Note: compile costs] in cost/fused.py);
3. Table 1, FSDP + torch.compile + float8: ``float8_fraction`` ([Note: float8 costs]), tensorwise
   with the float8 all-gather and its precomputed scales, the settings TorchTitan's float8 guide gives;
4. Table 2, FSDP 8 / CP 1 at 32768 tokens (local batch 1, full AC, compile + float8): the attention
   fraction (``attention_fraction``). Attention is about three quarters of this row's compute and a
   quarter to a third of Table 1's, so this row is the one that determines it; on Table 1 alone the
   attention fraction trades against the GEMM fraction (and carried from the H100 SXM's llm-foundry
   fit, on rows of 8192 tokens and shorter, it left float8_fraction x GEMM fraction above 1).

Rule: the four rows are solved jointly, since every constant moves every row it prices: Newton's
method on the four rows' log(predicted / published tokens/s) in the four constants' logs, starting
from the preset's shipped constants, the Jacobian by forward differences (1% steps) at the first step,
again only when a step fails to shrink the worst row, until every row is within 0.1% of published;
the constants are then rounded to three decimals and the rows reported as rounded (from the three-row
fit's 0.865, 2.902, 1.209 with attention 0.200: five steps, 0.732, 2.899, 0.990, 0.279; rounded, the
rows read 0.9999, 0.9999, 0.9991, 0.9997). Held out: Table 2's 65536 and 131072 rows (context
parallel), Tables 3 (the same on 128 GPUs), 4 and 5, and A (the async-TP note's rows). The other
Hopper presets keep the H100 SXM's llm-foundry fractions and the knob constants of the earlier
three-row Table 1 fit (which carried that attention fraction, 0.200: the pair fitted together).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

from wrapopt.hardware import catalog

GPU = "h100-hbm2e-500w"
FIELDS = ("matmul_fraction", "compile_fraction", "float8_fraction", "attention_fraction")
TOLERANCE = 1e-3  # every row within 0.1% of published


def fit_rows() -> list[tuple[str, str, int, list[str], str, float, int]]:
    """The four rows, in FIELDS' order: (name, constant, world, flags, --current, published tokens/s/GPU,
    tokens per step), taken from the scripts that report them."""
    from benchmarks import torchtitan_cp as cp
    from benchmarks import torchtitan_rows as tr

    out = []
    for (table, row, _model, world, flags, current, tps, _gib), field in zip(tr.ROWS[:3], FIELDS):
        assert table == "1", tr.ROWS[:3]
        out.append((f"Table 1, {row}", field, world, flags, current, tps,
                    int(flags[flags.index("--global-batch") + 1]) * tr.SEQ))
    row, seq, degree, tps, _gib = cp.ROWS[0]
    assert degree == 1, cp.ROWS[0]
    out.append((f"Table 2, {row} at {seq}", FIELDS[3], 8, cp._flags(seq, 1), cp._CURRENT, tps, 8 * seq))
    return out


def log_ratios(path: str, rows: list, values: dict[str, float]) -> list[float]:
    """log(predicted / published tokens/s/GPU) of each row, the preset's constants set to ``values``."""
    from benchmarks.torchtitan_rows import predict

    catalog.GPUS[GPU] = catalog.GPUS[GPU].with_fitted(**values)
    out = []
    for _name, _field, world, flags, current, tps, tokens in rows:
        cur, _split = predict(path, world, flags, current)
        out.append(math.log(tokens / world / cur["step_s"] / tps))
    return out


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (Gaussian elimination with partial pivoting; a is 4 x 4)."""
    n = len(b)
    m = [list(r) + [v] for r, v in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            raise ValueError("torchtitan_fit: the fit rows' Jacobian is singular; a constant moves no row")
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def _jacobian(path: str, rows: list, values: dict[str, float], base: list[float]) -> list[list[float]]:
    """d log(ratio_i) / d log(constant_j), by forward differences of 1%."""
    cols = []
    for field in FIELDS:
        moved = log_ratios(path, rows, {**values, field: values[field] * 1.01})
        cols.append([(m - b) / math.log(1.01) for m, b in zip(moved, base)])
    return [[cols[j][i] for j in range(len(FIELDS))] for i in range(len(rows))]


def fit(path: str, iterations: int = 12) -> dict[str, float]:
    """The four constants: See [Note: the TorchTitan fit]."""
    rows = fit_rows()
    fitted = catalog.GPUS[GPU].fitted
    values = {f: float(getattr(fitted, f)) for f in FIELDS}
    base = log_ratios(path, rows, values)
    jac = None
    for _ in range(iterations):
        print(json.dumps({k: round(v, 5) for k, v in values.items()}),
              " ".join(f"{math.exp(r):.4f}" for r in base), flush=True)
        if max(abs(r) for r in base) < math.log1p(TOLERANCE):
            break
        jac = jac or _jacobian(path, rows, values, base)
        step = _solve(jac, [-r for r in base])
        trial = {f: values[f] * math.exp(s) for f, s in zip(FIELDS, step)}
        moved = log_ratios(path, rows, trial)
        if max(map(abs, moved)) >= max(map(abs, base)):  # the old Jacobian no longer points the way
            jac = _jacobian(path, rows, values, base)
            continue
        values, base = trial, moved
    else:
        raise RuntimeError(f"torchtitan_fit: rows not within {TOLERANCE:.1%} after {iterations} steps")
    values = {f: round(v, 3) for f, v in values.items()}
    for (name, *_), r in zip(rows, log_ratios(path, rows, values)):
        print(f"{name}: pred/pub {math.exp(r):.4f}", flush=True)
    return values


def main() -> int:
    from benchmarks.torchtitan_rows import CONFIGS

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama3.1-8b.json")
        with open(path, "w") as f:
            json.dump(CONFIGS["llama3.1-8b"], f)
        print(json.dumps(fit(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
