"""The wider bench set: small CPU-trainable models built differently from the zoo's.

The zoo's four trainable models are where the simulator and the search were
tuned; these check that plans hold on models wrapopt was not built around
(issue 21). Each is registered in the zoo (``zoo:tx-encoder``, ...) with
``suite="bench"``:

- ``tx-encoder``: ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer`` (batch first,
  pre-norm): ``nn.MultiheadAttention`` reads its ``out_proj`` weight without calling it;
- ``tx-tied``: a GPT of causal ``nn.TransformerEncoderLayer`` blocks with the head tied to the
  embedding (issue 33: the memory model on stock modules with a tied pair);
- ``tx-decoder``: ``nn.Transformer`` (encoder and decoder stacks, cross-attention to the
  encoder's memory, post-norm), untied embeddings;
- ``wide-shallow``: 2 wide decoder blocks (d=256, FFN 1024) with a fused qkv projection;
- ``deep-narrow``: 20 narrow decoder blocks (d=32);
- ``big-vocab``: a 32k vocabulary, untied embedding and head hold ~98% of the parameters;
- ``moe-tiny``: blocks whose FFN is a mixture of experts with data-dependent top-2 routing
  (GShard-style dispatch into fixed-capacity expert buffers, so shapes do not depend on
  the data and the model traces on the meta device);
- ``lora-tiny``: a frozen Llama-style base (``requires_grad=False``) with trainable LoRA
  adapters on the q and v projections;
- ``mha-tied``: a GPT whose blocks a user wrote around ``nn.MultiheadAttention`` (its fused
  ``in_proj``, a causal mask, an ``nn.Sequential`` MLP), the head tied to the embedding
  (issue 51: the CPU step model on a held-out model of that family).

Every model is deterministic under a seed (dropout 0) and runs steps of tens of
milliseconds on 2 gloo ranks of a CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from wrapopt.models.entry import ZooEntry, lm_loss, src_tgt, tokens

__all__ = ["BENCH", "TxEncoderLM", "TxCausalLM", "TxSeq2Seq", "FusedDecoder", "MoEFFN", "LoRALinear", "LoRALlama",
           "MHAGPT"]


# --- built from torch.nn.Transformer* layers ------------------------------------------------------


class TxEncoderLM(nn.Module):
    """Token and position embeddings, an ``nn.TransformerEncoder`` and a linear head."""

    def __init__(self, *, vocab: int, dim: int, n_layers: int, n_heads: int, ffn: int, max_seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        layer = nn.TransformerEncoderLayer(dim, n_heads, ffn, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(dim), enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.encoder(x))


class TxCausalLM(nn.Module):
    """A GPT built from stock modules: ``nn.TransformerEncoderLayer`` blocks run causally in an
    ``nn.ModuleList``, the head tied to the token embedding."""

    def __init__(self, *, vocab: int, dim: int, n_layers: int, n_heads: int, ffn: int, max_seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, n_heads, ffn, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


class TxSeq2Seq(nn.Module):
    """``nn.Transformer`` between untied source and target embeddings and a head; the target is causal."""

    def __init__(self, *, vocab: int, dim: int, n_enc: int, n_dec: int, n_heads: int, ffn: int):
        super().__init__()
        self.src_embed = nn.Embedding(vocab, dim)
        self.tgt_embed = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(dim, n_heads, n_enc, n_dec, ffn, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        out = self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=mask, tgt_is_causal=True)
        return self.head(out)


# --- decoders with a fused qkv projection ------------------------------------------------------------


class FusedAttention(nn.Module):
    """Causal self-attention with one ``qkv`` projection (GPT-2 / nanoGPT style)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoEFFN(nn.Module):
    """A mixture of ``num_experts`` MLPs, ``top_k`` per token, weights of all experts stacked.

    Routing depends on the data (the router's top-k), shapes do not: each expert
    takes a fixed ``capacity`` of tokens (GShard's dispatch: the (token, choice)
    pairs in order, first choices before second, fill each expert's slots; pairs
    past its capacity are dropped) and the dispatch and combine are one-hot
    tensors, so the block traces on the meta device and costs the same on every step.
    """

    def __init__(self, dim: int, hidden: int, *, num_experts: int, top_k: int, capacity_factor: float = 1.25):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, dim, hidden) * dim ** -0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        n, e, k = t.shape[0], self.num_experts, self.top_k
        capacity = math.ceil(k * n / e * self.capacity_factor)
        weights, chosen = self.router(t).softmax(-1).topk(k, dim=-1)  # (n, k)
        weights = weights / weights.sum(-1, keepdim=True)
        # (k * n, e): one row per (choice, token), choice-major, so first choices queue first.
        onehot = F.one_hot(chosen.t().reshape(-1), e).to(t.dtype)
        slot = ((onehot.cumsum(0) - 1) * onehot).sum(-1).long()  # place in its expert's queue
        kept = (slot < capacity).to(t.dtype)
        dispatch = ((onehot * kept[:, None])[:, :, None]
                    * F.one_hot(slot.clamp(max=capacity - 1), capacity).to(t.dtype)[:, None, :])
        dispatch = dispatch.view(k, n, e, capacity)
        combine = (dispatch * weights.t().reshape(k, n, 1, 1)).sum(0)  # (n, e, capacity)
        expert_in = torch.einsum("nec,nd->ecd", dispatch.sum(0), t)
        return torch.einsum("nec,ecd->nd", combine, self.experts_forward(expert_in)).reshape(shape)

    def experts_forward(self, buffer: torch.Tensor) -> torch.Tensor:
        """Every expert over its buffer of ``capacity`` tokens: ``(experts, capacity, dim)`` in and out
        (expert parallelism sends the buffers to the ranks that hold their experts: See [Note:
        applying expert parallelism] in wrapopt/plan/ep.py)."""
        return torch.bmm(F.gelu(torch.bmm(buffer, self.w_in)), self.w_out)


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, ffn: int, *, moe: dict | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = FusedAttention(dim, n_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.ffn = MoEFFN(dim, ffn, **moe) if moe else MLP(dim, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class FusedDecoder(nn.Module):
    """A decoder LM of ``DecoderBlock``s in an ``nn.Sequential``, untied embedding and head."""

    def __init__(self, *, vocab: int, dim: int, n_layers: int, n_heads: int, ffn: int, max_seq: int,
                 moe: dict | None = None):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, max_seq, dim) * 0.02)
        self.blocks = nn.Sequential(*(DecoderBlock(dim, n_heads, ffn, moe=moe) for _ in range(n_layers)))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        return self.out(self.norm(self.blocks(x)))


# --- frozen base, trainable adapters ----------------------------------------------------------------


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))``: ``base`` frozen, ``A`` and ``B`` (zero-initialised) trained."""

    def __init__(self, dim_in: int, dim_out: int, rank: int, alpha: float = 16.0):
        super().__init__()
        self.base = nn.Linear(dim_in, dim_out, bias=False)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(dim_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim_out, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))


class LoRAAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, rank: int):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = LoRALinear(dim, dim, rank)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = LoRALinear(dim, dim, rank)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, d))


class LoRABlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, ffn: int, rank: int):
        super().__init__()
        self.input_norm = nn.RMSNorm(dim)
        self.self_attn = LoRAAttention(dim, n_heads, rank)
        self.post_norm = nn.RMSNorm(dim)
        self.mlp = MLP(dim, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_norm(x))
        return x + self.mlp(self.post_norm(x))


class LoRALlama(nn.Module):
    """A Llama-style decoder whose every parameter is frozen except the adapters' ``lora_a``/``lora_b``."""

    def __init__(self, *, vocab: int, dim: int, n_layers: int, n_heads: int, ffn: int, rank: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LoRABlock(dim, n_heads, ffn, rank) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.named_parameters():
            p.requires_grad_(".lora_" in name)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# --- blocks written around nn.MultiheadAttention ---------------------------------------------------


class MHABlock(nn.Module):
    """Pre-norm block as a user writes it: ``nn.MultiheadAttention`` (fused ``in_proj``, no weights
    returned) under a causal mask, then an ``nn.Sequential`` MLP."""

    def __init__(self, dim: int, n_heads: int, ffn: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class MHAGPT(nn.Module):
    """A GPT of ``MHABlock``s in an ``nn.ModuleList`` with learned positions, the head tied to the embedding."""

    def __init__(self, *, vocab: int, dim: int, n_layers: int, n_heads: int, ffn: int, max_seq: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(MHABlock(dim, n_heads, ffn) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


# --- the entries -------------------------------------------------------------------------------------


def _bench(name: str, description: str, factory, make_inputs, batch: int) -> ZooEntry:
    return ZooEntry(name, description, factory, make_inputs, lm_loss, batch, True, suite="bench")


BENCH: tuple[ZooEntry, ...] = (
    _bench("tx-encoder", "nn.TransformerEncoder of 4 nn.TransformerEncoderLayer (batch first, pre-norm), "
           "d=64, FFN 256, "
           "nn.MultiheadAttention", lambda: TxEncoderLM(vocab=2048, dim=64, n_layers=4, n_heads=4, ffn=256, max_seq=64),
           tokens(2048, 64), 4),
    _bench("tx-tied", "GPT of 6 causal nn.TransformerEncoderLayer blocks (nn.MultiheadAttention, pre-norm) in an "
           "nn.ModuleList, d=96, FFN 384, head tied to the embedding",
           lambda: TxCausalLM(vocab=2048, dim=96, n_layers=6, n_heads=4, ffn=384, max_seq=64), tokens(2048, 64), 4),
    _bench("tx-decoder", "nn.Transformer, 2 encoder + 3 decoder layers (cross-attention to the memory, "
           "post-norm), d=64, "
           "FFN 256, untied embeddings", lambda: TxSeq2Seq(vocab=2048, dim=64, n_enc=2, n_dec=3, n_heads=4, ffn=256),
           src_tgt(2048, 32), 4),
    _bench("wide-shallow", "decoder, 2 wide blocks (d=256, FFN 1024, fused qkv) in an nn.Sequential, untied head",
           lambda: FusedDecoder(vocab=2048, dim=256, n_layers=2, n_heads=4, ffn=1024, max_seq=64), tokens(2048, 64), 4),
    _bench("deep-narrow", "decoder, 20 narrow blocks (d=32, FFN 128, fused qkv) in an nn.Sequential, untied head",
           lambda: FusedDecoder(vocab=2048, dim=32, n_layers=20, n_heads=2, ffn=128, max_seq=64), tokens(2048, 64), 4),
    _bench("big-vocab", "decoder, vocabulary 32000, untied embedding and head (~98% of the parameters), 2 blocks, d=64",
           lambda: FusedDecoder(vocab=32000, dim=64, n_layers=2, n_heads=4, ffn=256, max_seq=32), tokens(32000, 32), 4),
    _bench("moe-tiny", "decoder, 4 blocks whose FFN is a mixture of 4 experts, data-dependent top-2 routing into "
           "fixed-capacity buffers, d=64",
           lambda: FusedDecoder(vocab=2048, dim=64, n_layers=4, n_heads=4, ffn=128, max_seq=32,
                                moe={"num_experts": 4, "top_k": 2}),
           tokens(2048, 32), 4),
    _bench("lora-tiny", "Llama-style decoder, 4 blocks, d=64, frozen base, trainable LoRA (rank 8) on q and v",
           lambda: LoRALlama(vocab=2048, dim=64, n_layers=4, n_heads=4, ffn=176, rank=8), tokens(2048, 64), 4),
    _bench("mha-tied", "GPT of 8 user blocks around nn.MultiheadAttention (fused in_proj, causal mask), d=64, "
           "FFN 256, head tied to the embedding",
           lambda: MHAGPT(vocab=2048, dim=64, n_layers=8, n_heads=4, ffn=256, max_seq=64), tokens(2048, 64), 4),
)
