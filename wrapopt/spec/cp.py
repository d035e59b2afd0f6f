"""What context parallelism needs of a model: its attention as causal SDPA, and a sequence that
splits into ``2 x cp`` chunks (the head-tail load balancer's). Shared: the search refuses and
chooses degrees with it, the cost view finds the modules whose attention it exchanges. See [Note:
context parallel costs] in wrapopt/cost/cp.py and [Note: context parallel search] in
wrapopt/search/cp.py."""

from __future__ import annotations

from wrapopt.spec.graph import ModelGraph, ModuleInfo

__all__ = ["attention_modules", "cp_degrees", "cp_refusal", "cp_ranks_per_node"]


def attention_modules(graph: ModelGraph) -> tuple[ModuleInfo, ...]:
    """The modules whose own ops run an attention kernel (SDPA, flash or efficient attention)."""
    return tuple(m for m in graph.modules if m.attention_flops > 0 and m.num_calls > 0)


def cp_refusal(graph: ModelGraph) -> str | None:
    """None when context parallelism can shard the model's attention (every block runs causal SDPA),
    else why not, naming the module: torch's ``context_parallel`` replaces
    ``scaled_dot_product_attention``, so attention written as matmuls and a softmax is not split,
    and its head-tail load balancer needs ``is_causal=True`` (the kernel then skips half the
    scores: ``attention_run_flops``)."""
    if not graph.seq_len:
        return "the model's inputs have no sequence dimension to split (no --seq)"
    with_sdpa = {m.fqn for m in attention_modules(graph)}
    for block in graph.blocks:
        if any(f == block or f.startswith(block + ".") for f in with_sdpa):
            continue
        inner = [f for f in graph.subtree(block) if "attn" in f.rsplit(".", 1)[-1].lower()
                 or "attention" in graph.info(f).cls.lower()]
        where = inner[0] if inner else block
        return (f"{where} ({graph.info(where).cls}) computes attention without scaled_dot_product_attention, "
                "which context parallelism shards (torch's context_parallel replaces SDPA); use an SDPA "
                "attention (Hugging Face: attn_implementation=\"sdpa\"), or --cp 1")
    if not with_sdpa:
        return ("no module runs scaled_dot_product_attention, which context parallelism shards "
                "(torch's context_parallel replaces SDPA); pass --cp 1")
    full = next((m for m in attention_modules(graph) if m.attention_run_flops >= m.attention_flops), None)
    if full is not None:  # the kernel ran every score: no is_causal (an encoder, cross-attention or a mask)
        return (f"{full.fqn} ({full.cls}) runs attention without is_causal=True (an encoder, cross-attention or an "
                "explicit mask), which context parallelism's load balancer and ring attention do not take; "
                "pass --cp 1")
    return None


def cp_degrees(seq: int, ranks: int, top: int = 64) -> tuple[int, ...]:
    """The cp degrees above 1 that split ``seq`` into ``2 x cp`` chunks and divide ``ranks``."""
    return tuple(c for c in (2, 4, 8, 16, 32, 64) if c <= top and ranks % c == 0 and seq % (2 * c) == 0)


def cp_ranks_per_node(cp: int, ranks_per_node: int, tp: int = 1) -> int:
    """Ranks of one cp group on a node: the cp ranks sit ``tp`` apart, inside a node while ``cp x tp``
    fits one (See [Note: context parallel costs] in cost/cp.py)."""
    return max(1, min(cp, ranks_per_node // tp))
