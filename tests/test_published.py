"""The published-runs benchmark's inputs: the shared llm-foundry tables parse, and the
MPT built on meta has exactly each row's NumParams (benchmarks/published_rows.py)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.published_predict import Predictor
from benchmarks.published_rows import (
    DEFAULT_SOURCE, build_mpt, count_params, fused_cross_entropy, parse_published, with_master_weights,
)

pytestmark = pytest.mark.skipif(not os.path.exists(DEFAULT_SOURCE),
                                reason=f"shared file {DEFAULT_SOURCE} is absent "
                                       "(the note lives outside the repository)")


@pytest.fixture(scope="module")
def published():
    return parse_published(DEFAULT_SOURCE)


def test_every_table_parses_with_its_stated_row_count(published):
    names = [n for n, _s, _p in published.sections]
    assert any(n.startswith("A100 40GB") for n in names) and any(n.startswith("A100 80GB") for n in names)
    assert any(n.startswith("H100 80GB") for n in names)
    for name, stated, parsed in published.sections:
        assert parsed == stated, name
    assert not published.skipped
    assert {r.gpu for r in published.rows} <= {"a100_40gb", "a100_80gb", "h100_80gb"}
    assert all(r.model in published.shapes for r in published.rows)
    assert published.vocab > 0


def test_built_mpt_has_the_rows_numparams(published):
    rows = []
    for gpu in ("a100_40gb", "a100_80gb"):
        of_gpu = [r for r in published.rows if r.gpu == gpu]
        rows += [of_gpu[0], of_gpu[-1], max(of_gpu, key=lambda r: r.seq_len)]  # 70b, 125m, the longest sequence
    for r in rows:
        model = build_mpt(published.shapes[r.model], vocab=published.vocab, seq_len=r.seq_len)
        assert all(p.is_meta for p in model.parameters())
        assert count_params(model) == r.num_params, r.label


def test_mismatched_or_unmodelled_rows_are_skipped_with_the_reason(tmp_path, published):
    lines = open(DEFAULT_SOURCE, encoding="utf-8").read().splitlines()
    a100 = next(i for i, l in enumerate(lines) if l.startswith("|  125m") and "a100_40gb" in l)
    cells = lines[a100].split("|")
    cells[-2] = f" {int(cells[-2]) + 1} "  # NumParams off by one
    lines[a100] = "|".join(cells)
    lines.insert(a100 + 1, "|  125m | 2048 | 8 | a100_40gb | 1 |")  # too few cells
    src = tmp_path / "note.md"
    src.write_text("\n".join(lines), encoding="utf-8")
    p = parse_published(str(src))
    assert len(p.skipped) == 1 and "cells" in p.skipped[0].reason
    ok, skipped = Predictor(p).usable(p.rows)
    reasons = {s.row.line: s.reason for s in skipped}
    assert "parameters" in reasons[a100 + 1]
    assert any("FP8" in r for r in reasons.values())  # the H100 FP8 table
    assert len(ok) + len(skipped) == len(p.rows)


def test_fused_cross_entropy_keeps_the_logits_only(published):
    """[Note: fused cross-entropy]: saved = the bf16 logits and the log-sum-exp, no fp32 copy."""
    from wrapopt.trace.meta import trace_model

    shape = published.shapes[min(published.shapes, key=lambda k: published.shapes[k].d_model)]
    tiny = type(shape)("tiny", 2, shape.d_model, shape.n_heads, shape.ffn)
    model = build_mpt(tiny, vocab=published.vocab, seq_len=64)
    g = trace_model(model, (torch.zeros(2, 64, dtype=torch.long),), loss_fn=fused_cross_entropy, fx=False)
    logits = 2 * 64 * published.vocab * 2  # bf16
    assert g.loss_saved_bytes == logits + 2 * 64 * 2  # and the bf16 log-sum-exp per token
    m = with_master_weights(g)
    assert m.param_bytes == 2 * g.param_bytes and m.num_params == g.num_params
    assert m.trainable_bytes == 2 * g.trainable_bytes


def test_the_configuration_headline_never_reports_a_loss_on_a_row_that_fits(published):
    from benchmarks.published_config import search_config, why_kind
    from wrapopt.search.choose import STEP_ERROR

    pred = Predictor(published)
    usable, _skipped = pred.usable(published.rows)
    small = [r for r in usable if r.model in ("125m", "350m") and r.num_gpus == 8][:2]
    assert small, "the tables have small-model rows on one node"
    for r in small:
        c = search_config(pred, r, max_group=2)
        assert c.global_batch == r.micro_batch * r.grad_accum * r.num_gpus
        if c.row_fits:
            assert c.speedup >= 1.0 and (c.own_is_best or c.chosen.startswith("mb "))
        # each gain alone is a ratio to the row's own configuration, scored when expressible
        assert all(g[3] > 0 for g in c.gains if g[3] == g[3])
        # the search says why its plan is per-block or beats it (See [Note: plans within the error])
        kind = why_kind(c.why)
        assert kind in ("per-block", "per-block does not fit") or (
            kind.startswith("beats per-block by ") and float(kind.split()[-1].rstrip("%")) > 100 * STEP_ERROR), c.why


def test_why_kind_reads_each_case_of_choose():
    from benchmarks.published_config import why_kind

    assert why_kind("per-block: nothing beats it by more than the simulator's 3.2% error") == "per-block"
    assert why_kind("beats per-block by 6.9% (> the simulator's 3.2% error)") == "beats per-block by 6.9%"
    assert why_kind("per-block does not fit the budget: the simplest plan within x") == "per-block does not fit"
