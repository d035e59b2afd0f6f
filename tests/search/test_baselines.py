"""search/baselines.py: the named policies, and the size-based one replaying FSDP1's recursion."""

from __future__ import annotations

from tests.search.common import zoo_graph
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec


def test_baselines_are_the_named_policies():
    g = zoo_graph("gpt-tiny")
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    b = baselines(g, mesh)
    assert set(b) == {"per-block", "per-block,ckpt", "size-1e8", "every-leaf", "root-only", "no-shard"}
    assert [u.modules for u in b["per-block"].units[:-1]] == [(f"layers.{i}",) for i in range(4)]
    # Full activation checkpointing: the same cut, every block resharded and checkpointed, the root kept.
    ckpt = b["per-block,ckpt"].units
    assert [u.modules for u in ckpt] == [u.modules for u in b["per-block"].units]
    assert all(u.checkpoint and u.reshard_after_forward is True for u in ckpt[:-1])
    assert ckpt[-1].is_root and not ckpt[-1].checkpoint and ckpt[-1].reshard_after_forward is False
    assert len(b["root-only"].units) == 1 and len(b["size-1e8"].units) == 1  # nothing reaches 1e8 in a tiny model
    assert b["no-shard"].mesh.shard_size == 1
    leaves = {m for u in b["every-leaf"].units for m in u.modules}
    assert "wte" not in leaves and "lm_head" not in leaves  # tied: left to the root
    assert "layers.0.attn.q_proj" in leaves


def test_size_based_replays_fsdp1_on_llama7b():
    g = zoo_graph("llama-7b")
    b = baselines(g, MeshSpec(world_size=64, ranks_per_node=8, shard_size=64))["size-1e8"]
    names = {m for u in b.units for m in u.modules}
    # FSDP1's recursion: each MLP (135M) reaches 1e8 and is wrapped; what is left of
    # its block (attention, 67M) does not, so the blocks themselves stay unwrapped.
    assert all(f"layers.{i}.mlp" in names and f"layers.{i}" not in names for i in range(32))
    assert "embed_tokens" in names and "lm_head" in names  # 131M each
