"""search/tp.py under ``--tp auto``: every degree tried or dropped is reported, with the reason."""

from __future__ import annotations

from tests.search.common import make_sim, zoo_graph
from wrapopt.report.choice import format_search, search_json
from wrapopt.search.driver import SearchOptions
from wrapopt.search.tp import auto_degrees, search_tp
from wrapopt.spec import MeshSpec


def test_auto_names_every_degree_and_why_one_was_dropped():
    g = zoo_graph("llama-tiny")
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    degrees, spec, dropped = auto_degrees(g, mesh)
    assert degrees == (1, 2) and spec is not None
    assert [d for d, _ in dropped] == [4, 8] and all("heads" in why for _, why in dropped)
    res = search_tp(g, make_sim(g, 16), mesh, spec=spec, degrees=degrees, dropped=dropped,
                    options=SearchOptions(trials=0))
    tried = dict(res.tp_tried)
    assert sorted(tried) == [1, 2, 4, 8] and tried[res.tp_chosen] == "chosen"
    other = 2 if res.tp_chosen == 1 else 1
    assert tried[other].startswith("fits, ")
    line = next(x for x in format_search(res).splitlines() if x.startswith("--tp auto: "))
    assert line.endswith("tp 4, 8: dropped: does not divide the heads of layers.0.self_attn (4 heads, "
                         "2 key-value heads)")
    assert [r["tp"] for r in search_json(res, None)["tp_tried"]] == [1, 2, 4, 8]


def test_auto_without_a_recognised_block_says_so():
    g = zoo_graph("moe-tiny")  # fused qkv: wrapopt cannot split it
    mesh = MeshSpec(world_size=4, ranks_per_node=4, shard_size=4)
    degrees, spec, dropped = auto_degrees(g, mesh)
    assert degrees == (1,) and spec is None and [d for d, _ in dropped] == [2, 4]
    res = search_tp(g, make_sim(g, 4), mesh, spec=None, degrees=degrees, dropped=dropped,
                    options=SearchOptions(trials=0))
    assert "--tp auto: tp 1: chosen; tp 2, 4: dropped: no block wrapopt can split" in format_search(res)
