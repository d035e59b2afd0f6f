"""The model zoo behind ``zoo:NAME``: small models that train on 2 CPU ranks, and
planning-only shapes (``llama-7b``, ``llama-70b``, ``llama3-405b``) that are built on the meta device.
The wider bench set (``bench_models.py``: models built from ``torch.nn.Transformer*``
layers, other shapes, a mixture of experts, frozen base with adapters) is registered
here too, with ``ZooEntry.suite == "bench"``.

Each entry builds a model, example inputs at a given batch, and a loss, so the
same entry serves tracing, the demo, the benchmarks and the tests.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from wrapopt.errors import ModelError
from wrapopt.models.bench_models import BENCH
from wrapopt.models.entry import ZooEntry, cls_loss, images, lm_loss, src_tgt, tokens

__all__ = ["ZooEntry", "ZOO", "get_entry", "build"]


# --- building blocks ---------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim), computed on the fly."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    ang = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, bias: bool, causal: bool,
                 rotary: bool):
        super().__init__()
        self.n_heads, self.n_kv = n_heads, n_kv_heads or n_heads
        self.head_dim = dim // n_heads
        self.causal, self.rotary = causal, rotary
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        kv_in = x if context is None else context
        # Head counts come from the shapes (-1), so that a tensor-parallel rank, whose
        # projections hold n_heads / tp heads, runs the same code.
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(kv_in).view(b, kv_in.shape[1], -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], -1, self.head_dim).transpose(1, 2)
        if self.rotary:
            q, k = _rotary(q), _rotary(k)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal and context is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# --- GPT (tied embeddings) -------------------------------------------------------------


class GPTBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads, bias=True, causal=True, rotary=False)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = GeluMLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, *, vocab: int, dim: int, n_layers: int, n_heads: int, max_seq: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(GPTBlock(dim, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


# --- Llama ---------------------------------------------------------------------------------


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn: int):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = Attention(dim, n_heads, n_kv_heads, bias=False, causal=True, rotary=True)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, *, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, n_heads, n_kv_heads, ffn) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# --- ViT -------------------------------------------------------------------------------------


class ViTBlock(GPTBlock):
    def __init__(self, dim: int, n_heads: int):
        super().__init__(dim, n_heads)
        self.attn.causal = False


class ViT(nn.Module):
    def __init__(self, *, image: int, patch: int, dim: int, n_layers: int, n_heads: int, classes: int):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        self.blocks = nn.ModuleList(ViTBlock(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


# --- T5-style encoder-decoder --------------------------------------------------------------


class T5EncoderBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, ffn: int):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = Attention(dim, n_heads, bias=False, causal=False, rotary=True)
        self.norm2 = RMSNorm(dim)
        self.mlp = GeluMLP(dim, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class T5DecoderBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, ffn: int):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.self_attn = Attention(dim, n_heads, bias=False, causal=True, rotary=True)
        self.norm2 = RMSNorm(dim)
        self.cross_attn = Attention(dim, n_heads, bias=False, causal=False, rotary=False)
        self.norm3 = RMSNorm(dim)
        self.mlp = GeluMLP(dim, ffn)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x))
        x = x + self.cross_attn(self.norm2(x), memory)
        return x + self.mlp(self.norm3(x))


class T5Stack(nn.Module):
    def __init__(self, block: Callable[[], nn.Module], n_layers: int, dim: int):
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n_layers))
        self.final_norm = RMSNorm(dim)


class T5(nn.Module):
    def __init__(self, *, vocab: int, dim: int, n_layers: int, n_heads: int, ffn: int):
        super().__init__()
        self.shared = nn.Embedding(vocab, dim)
        self.encoder = T5Stack(lambda: T5EncoderBlock(dim, n_heads, ffn), n_layers, dim)
        self.decoder = T5Stack(lambda: T5DecoderBlock(dim, n_heads, ffn), n_layers, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.shared.weight  # T5 ties input and output embeddings

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        h = self.shared(src)
        for block in self.encoder.blocks:
            h = block(h)
        memory = self.encoder.final_norm(h)
        y = self.shared(tgt)
        for block in self.decoder.blocks:
            y = block(y, memory)
        return self.lm_head(self.decoder.final_norm(y))


# --- registry ----------------------------------------------------------------------------------


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry("gpt-tiny", "GPT-2 style, 4 blocks, d=64, tied input/output embeddings",
                 lambda: GPT(vocab=2048, dim=64, n_layers=4, n_heads=4, max_seq=64),
                 tokens(2048, 64), lm_loss, 4, True),
        ZooEntry("llama-tiny", "Llama style, 6 blocks, d=64, GQA (4 heads, 2 KV), SwiGLU, RMSNorm",
                 lambda: Llama(vocab=2048, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn=176),
                 tokens(2048, 64), lm_loss, 4, True),
        ZooEntry("vit-tiny", "ViT, 32x32 images, 4x4 patches, 4 blocks, d=64",
                 lambda: ViT(image=32, patch=4, dim=64, n_layers=4, n_heads=4, classes=10),
                 images(32), cls_loss, 8, True),
        ZooEntry("t5-tiny", "T5 style encoder-decoder, 3+3 blocks, d=64, shared embeddings tied to the head",
                 lambda: T5(vocab=2048, dim=64, n_layers=3, n_heads=4, ffn=256), src_tgt(2048, 32), lm_loss, 4, True),
        ZooEntry("llama-7b", "Llama-2 7B shapes: 32 blocks, d=4096, FFN 11008, vocab 32000 (planning only, meta)",
                 lambda: Llama(vocab=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn=11008),
                 tokens(32000, 4096), lm_loss, 1, False),
        ZooEntry("llama-70b", "Llama-2 70B shapes: 80 blocks, d=8192, FFN 28672, 64 heads, 8 KV heads "
                 "(planning only, meta)",
                 lambda: Llama(vocab=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn=28672),
                 tokens(32000, 4096), lm_loss, 1, False),
        ZooEntry("llama3-405b", "Llama 3.1 405B shapes: 126 blocks, d=16384, FFN 53248, 128 heads, 8 KV heads, "
                 "vocab 128256, 8192 tokens (planning only, meta)",
                 lambda: Llama(vocab=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn=53248),
                 tokens(128256, 8192), lm_loss, 1, False),
    )
} | {e.name: e for e in BENCH}


def get_entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise ModelError(f"no zoo model named {name!r}; choose one of: {', '.join(ZOO)}")
    return ZOO[name]


def build(name: str, device: str | torch.device = "cpu", *, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    """``(model, example_inputs)`` for a zoo name; planning-only models default to meta."""
    entry = get_entry(name)
    if not entry.trainable:
        device = "meta"
    return entry.build(device, seed=seed), entry.inputs(device="cpu")

