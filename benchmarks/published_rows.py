"""Published FSDP runs, read at run time, and the models they trained, built on meta.

Used by ``benchmarks/published.py`` (and its test). The source is the shared
note ``../shared/published/llm_foundry.md``: MosaicML llm-foundry's MPT
throughput tables, copied verbatim with their model shapes. Nothing here
hard-codes a row: the tables, the shapes table and the vocabulary are parsed
from the file, and a row that cannot be used is returned as skipped with the
reason.

[Note: the MPT built here] llm-foundry's MPT as its benchmark configs set it
(``scripts/train/yamls/pretrain/mpt-*.yaml``): learned position embeddings
(seq x d), embeddings tied to the output head, LayerNorm with bias, fused
``Wqkv`` and ``out_proj`` with biases, a GELU MLP of 4 d, no dropout. Its
parameter count is ``12 d^2 L + V d + S d + 9 d L + 2 d (2L + 1)``, the
tables' NumParams column; every row is checked against it exactly. Module
names follow llm-foundry's (``blocks.N.attn.Wqkv``, ``blocks.N.ffn.up_proj``).

[Note: fused cross-entropy] llm-foundry's MPT trains with flash-attn's fused
cross-entropy (``loss_fn: fused_crossentropy``, its default): one kernel
reads the bf16 logits and keeps only them and the log-sum-exp for backward,
whose kernel writes the logits' gradient. ``fused_cross_entropy`` has the
same saved tensors and memory traffic on meta tensors (a ``logsumexp`` read
of the logits forward, a ``softmax``-shaped write backward), so the tracer
sees what the run held, not an fp32 log-softmax copy of the logits.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from wrapopt.spec import ModelGraph

__all__ = [
    "DEFAULT_SOURCE",
    "MptShape",
    "PublishedRow",
    "Skipped",
    "Published",
    "parse_published",
    "build_mpt",
    "count_params",
    "fused_cross_entropy",
    "with_master_weights",
]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SOURCE = os.path.join(os.path.dirname(REPO), "shared", "published", "llm_foundry.md")

_SECTION = re.compile(r'^#### README section "(?P<name>[^"]+)"\s*\((?P<n>\d+) rows\)')
_VOCAB = re.compile(r"\bvocab\s+(?P<v>\d[\d,]*)")


@dataclass(frozen=True, slots=True)
class MptShape:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    ffn: int


@dataclass(frozen=True, slots=True)
class PublishedRow:
    """One row of a published table, as printed (line number for reference)."""

    section: str
    line: int
    model: str
    seq_len: int
    num_gpus: int
    gpu: str  # "a100_40gb", "a100_80gb", "h100_80gb"
    mfu: float
    micro_batch: int
    grad_accum: int
    tokens_per_s_per_gpu: float  # "Throughput (T/s/GPU)"
    precision: str  # "bf16", "amp_bf16", "amp_fp8"
    mp_mode: str  # "PURE" or "DEFAULT"
    sharding: str  # "FULL_SHARD" or "SHARD_GRAD_OP"
    checkpointing: bool
    cpu_offload: bool
    num_params: int

    @property
    def label(self) -> str:
        return f"{self.model} s{self.seq_len} x{self.num_gpus}"


@dataclass(frozen=True, slots=True)
class Skipped:
    row: PublishedRow | None
    where: str  # "file:line"
    reason: str


@dataclass(frozen=True, slots=True)
class Published:
    source: str
    vocab: int
    shapes: dict[str, MptShape]
    rows: tuple[PublishedRow, ...]
    skipped: tuple[Skipped, ...]  # rows that could not be parsed
    sections: tuple[tuple[str, int, int], ...]  # (name, rows stated, rows parsed)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(lines: list[str]) -> list[tuple[int, list[str], list[tuple[int, list[str]]]]]:
    """Every markdown table: (header line number, header cells, [(line number, cells)])."""
    out = []
    i = 0
    while i < len(lines):
        if (lines[i].lstrip().startswith("|") and i + 1 < len(lines)
                and re.match(r"^\s*\|[\s\-:|]+\|\s*$", lines[i + 1])):
            head, body = _cells(lines[i]), []
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                body.append((j + 1, _cells(lines[j])))
                j += 1
            out.append((i + 1, head, body))
            i = j
        else:
            i += 1
    return out


_COLUMNS = {  # field -> published column name
    "model": "Model", "seq_len": "SeqLen (T)", "num_gpus": "# GPUs", "gpu": "GPU", "mfu": "MFU",
    "micro_batch": "MicroBatchSize", "grad_accum": "GradAccum", "tokens_per_s_per_gpu": "Throughput (T/s/GPU)",
    "precision": "Precision", "mp_mode": "MP Mode", "sharding": "Sharding Strategy",
    "checkpointing": "Activation Checkpointing", "cpu_offload": "Activation CPUOffload", "num_params": "NumParams",
}


def _bool(text: str) -> bool:
    if text not in ("True", "False"):
        raise ValueError(f"expected True or False, got {text!r}")
    return text == "True"


def _row(section: str, line: int, head: list[str], cells: list[str]) -> PublishedRow:
    if len(cells) != len(head):
        raise ValueError(f"{len(cells)} cells under a header of {len(head)}")
    d = dict(zip(head, cells))
    missing = [c for c in _COLUMNS.values() if c not in d]
    if missing:
        raise ValueError(f"no column {missing[0]!r}")
    get = lambda f: d[_COLUMNS[f]]  # noqa: E731
    return PublishedRow(
        section=section, line=line, model=get("model"), seq_len=int(get("seq_len")), num_gpus=int(get("num_gpus")),
        gpu=get("gpu"), mfu=float(get("mfu")), micro_batch=int(get("micro_batch")), grad_accum=int(get("grad_accum")),
        tokens_per_s_per_gpu=float(get("tokens_per_s_per_gpu")), precision=get("precision"), mp_mode=get("mp_mode"),
        sharding=get("sharding"), checkpointing=_bool(get("checkpointing")), cpu_offload=_bool(get("cpu_offload")),
        num_params=int(get("num_params")),
    )


def parse_published(path: str = DEFAULT_SOURCE) -> Published:
    """Read the shapes table, the vocabulary and every throughput table of the note.

    Raises ``FileNotFoundError`` when the file is absent and ``ValueError`` naming
    the line when the shapes table or the vocabulary cannot be found.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    m = _VOCAB.search(text)
    if m is None:
        raise ValueError(f"{path}: no 'vocab N' statement for the MPT vocabulary")
    vocab = int(m.group("v").replace(",", ""))
    shapes: dict[str, MptShape] = {}
    rows: list[PublishedRow] = []
    skipped: list[Skipped] = []
    sections: list[tuple[str, int, int]] = []
    heads = {i + 1: _SECTION.match(l) for i, l in enumerate(lines) if _SECTION.match(l)}
    for head_line, head, body in _tables(lines):
        if "n_layers" in head and "d_model" in head:
            for ln, cells in body:
                try:
                    d = dict(zip(head, cells))
                    shapes[d["Model"]] = MptShape(d["Model"], int(d["n_layers"]), int(d["d_model"]), int(d["n_heads"]),
                                                  int(d["FFN"]))
                except (KeyError, ValueError) as e:
                    skipped.append(Skipped(None, f"{path}:{ln}", f"shapes row not understood: {e}"))
            continue
        # A throughput table belongs to the closest section heading above it.
        above = [ln for ln in heads if ln < head_line]
        if not above or "NumParams" not in head:
            continue
        match = heads[max(above)]
        name, stated = match.group("name"), int(match.group("n"))
        parsed = 0
        for ln, cells in body:
            try:
                rows.append(_row(name, ln, head, cells))
                parsed += 1
            except ValueError as e:
                skipped.append(Skipped(None, f"{path}:{ln}", f"row not understood: {e}"))
        sections.append((name, stated, parsed))
    if not shapes:
        raise ValueError(f"{path}: no model shapes table (a table with n_layers and d_model columns)")
    return Published(os.path.abspath(path), vocab, shapes, tuple(rows), tuple(skipped), tuple(sections))


# --- the model ---------------------------------------------------------------------------------


class MptAttention(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.Wqkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.Wqkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, d))


class MptMlp(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.up_proj = nn.Linear(d, ffn)
        self.down_proj = nn.Linear(ffn, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class MptBlock(nn.Module):
    def __init__(self, d: int, n_heads: int, ffn: int):
        super().__init__()
        self.norm_1 = nn.LayerNorm(d)
        self.attn = MptAttention(d, n_heads)
        self.norm_2 = nn.LayerNorm(d)
        self.ffn = MptMlp(d, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.ffn(self.norm_2(x))


class Mpt(nn.Module):
    """See [Note: the MPT built here]."""

    def __init__(self, shape: MptShape, *, vocab: int, seq_len: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, shape.d_model)
        self.wpe = nn.Embedding(seq_len, shape.d_model)
        self.blocks = nn.ModuleList(MptBlock(shape.d_model, shape.n_heads, shape.ffn) for _ in range(shape.n_layers))
        self.norm_f = nn.LayerNorm(shape.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm_f(x), self.wte.weight)  # tied output head


def build_mpt(shape: MptShape, *, vocab: int, seq_len: int, dtype: torch.dtype = torch.bfloat16) -> Mpt:
    """The MPT of ``shape`` on the meta device (no weights), parameters in ``dtype``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return Mpt(shape, vocab=vocab, seq_len=seq_len)
    finally:
        torch.set_default_dtype(old)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied parameters once


class _FusedCrossEntropy(torch.autograd.Function):
    """See [Note: fused cross-entropy]."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(logits, lse)
        return lse.float().mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        logits, _lse = ctx.saved_tensors
        return torch.softmax(logits, dim=-1)  # the shape, dtype and traffic of the fused kernel's gradient


def fused_cross_entropy(output: torch.Tensor, inputs: tuple[Any, ...]) -> torch.Tensor:
    return _FusedCrossEntropy.apply(output.reshape(-1, output.shape[-1]))


def with_master_weights(graph: ModelGraph, *, bytes_per_element: int = 4) -> ModelGraph:
    """The graph of a model traced in bf16 (activations as mixed precision computes them)
    whose parameters are stored at ``bytes_per_element`` (fp32 master weights, as FSDP's
    mixed precision keeps them): sharded parameters, gradients and AdamW state are
    counted at that size, the gathered copy at ``SimOptions.param_dtype_bytes``."""
    infos = []
    tree = graph.tree.copy()  # new node attribute dicts: the traced graph stays as it was
    for m in graph.modules:
        k = bytes_per_element / (m.own_bytes / m.own_numel) if m.own_numel else 1.0
        t = bytes_per_element / (m.total_bytes / m.total_numel) if m.total_numel else 1.0
        info = dataclasses.replace(
            m, own_bytes=int(m.own_bytes * k), own_trainable_bytes=int(m.own_trainable_bytes * k),
            total_bytes=int(m.total_bytes * t),
            own_bytes_by_dtype=((f"float{8 * bytes_per_element}", int(m.own_bytes * k)),) if m.own_numel else ())
        tree.nodes[m.fqn]["info"] = info
        infos.append(info)
    shapes = tuple((n, s, f"float{8 * bytes_per_element}") for n, s, _ in graph.param_shapes)
    return dataclasses.replace(graph, modules=tuple(infos), tree=tree, param_shapes=shapes)
