"""planner.prune: dropping implied memory edges keeps every reachability and every data edge."""

from __future__ import annotations

import random

import pytest

from planner import build_memgraph, tight_capacity
from planner.prune import reduce_edges
from planner.symbolic import check_random_orders
from planner.verify import verify
from workloads.random_dag import random_dag


def closure(n: int, edges) -> list[int]:
    anc = [0] * n
    preds: list[list[int]] = [[] for _ in range(n)]
    for u, w, _ in edges:
        preds[w].append(u)
    for w in range(n):
        for u in preds[w]:
            anc[w] |= anc[u] | (1 << u)
    return anc


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("window", [1, 4, 64])
def test_reduction_keeps_reachability_and_data_edges(seed, window):
    rng = random.Random(seed)
    n = rng.randint(2, 60)
    preds = [
        [(u, "data" if rng.random() < 0.4 else "mem") for u in range(w) if rng.random() < 0.15]
        for w in range(n)
    ]
    edges = [(u, w, k) for w, ps in enumerate(preds) for u, k in ps]
    kept, dropped = reduce_edges(preds, window)
    assert len(kept) + dropped == len(edges)
    assert closure(n, kept) == closure(n, edges), f"seed {seed}: reachability changed"
    assert {e for e in edges if e[2] == "data"} <= set(kept), f"seed {seed}: a data edge was dropped"
    # within the window every implied memory edge is gone
    anc = closure(n, kept)
    for u, w, k in kept:
        if k == "mem" and w - u < window:
            others = [x for x, y, _ in kept if y == w and x != u]
            assert not any((anc[x] >> u) & 1 for x in others), f"seed {seed}: {u} -> {w} is implied"


@pytest.mark.parametrize("seed", range(4))
def test_pruned_plans_verify_and_run(seed):
    tg = random_dag(200, 3, seed, sizes=(16, 64, 256), far_prob=0.2)
    cap = tight_capacity(tg, 0.05)
    full = build_memgraph(tg, cap, window=0)
    pruned = build_memgraph(tg, cap)
    assert pruned.stats["implied_mem_edges"] > 0, f"seed {seed}: nothing was implied"
    mem = [sum(1 for e in m.edges if e[2] == "mem") for m in (full, pruned)]
    assert mem[1] == mem[0] - pruned.stats["implied_mem_edges"]
    assert pruned.stats["mem_edges_built"] == mem[0]
    assert verify(tg, pruned) == []
    check_random_orders(tg, pruned, 30, seed)
