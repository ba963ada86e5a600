"""The scalable verifier against brute force: planner.reach on random DAGs, planner.verify on mutated plans.

The reference here keeps every vertex's full ancestor set and tests every (read, overlapping
writer) pair: quadratic, independent of planner.reach and
planner.overlap. Small windows force the long-query paths (numpy two-step test, bidirectional
search) on small graphs.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

import planner.reach as reach_mod
from disco_ray.graph.memgraph import HOST, INPUT, Loc, MemGraph
from planner import build_memgraph, tight_capacity
from planner.reach import Reach
from planner.verify import verify
from workloads.random_dag import random_dag


def random_dag_preds(n: int, rng: random.Random, density: float) -> tuple[list[list[int]], list[int]]:
    """Predecessor lists of a random DAG on 0..n-1 (edges go up in a hidden order), and a topological order."""
    hidden = list(range(n))
    rng.shuffle(hidden)
    preds: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        for j in range(i):
            if rng.random() < density * (3.0 if i - j < 4 else 1.0):
                preds[hidden[i]].append(hidden[j])
    return preds, hidden


def full_ancestors(preds: list[list[int]], order: list[int]) -> list[int]:
    anc = [0] * len(preds)
    for v in order:
        for p in preds[v]:
            anc[v] |= anc[p] | (1 << p)
    return anc


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("window", [1, 3, 16, 4096])
def test_reach_matches_brute_force(seed, window):
    rng = random.Random(seed)
    n = rng.randint(2, 70)
    preds, order = random_dag_preds(n, rng, rng.choice([0.02, 0.06, 0.2]))
    anc = full_ancestors(preds, order)
    u = np.array([rng.randrange(n) for _ in range(400)])
    w = np.array([rng.randrange(n) for _ in range(400)])
    got = Reach(preds, order, window=window).ancestors(u, w)
    want = np.array([(anc[b] >> a) & 1 for a, b in zip(u, w)], dtype=bool)
    bad = np.flatnonzero(got != want)
    assert not len(bad), f"seed {seed} window {window}: wrong for pairs {list(zip(u[bad], w[bad]))[:5]}"


# ---- the whole verifier against a brute-force one -------------------------------------------------
def _arena(loc: Loc, gpu: int) -> tuple[int, int]:
    return (gpu, HOST) if loc.device == HOST else (loc.device, 0)


def brute_force_ordered(mg: MemGraph) -> bool:
    """FORMATS.md's ordering conditions (reads after their source, no race, outputs in place), by brute force."""
    pos = {v.id: i for i, v in enumerate(mg.vertices)}
    preds = [[] for _ in mg.vertices]
    for u, w, _ in mg.edges:
        preds[pos[w]].append(pos[u])
    indeg = [len(set(p)) for p in preds]
    succs = [[] for _ in mg.vertices]
    for w, ps in enumerate(preds):
        for u in set(ps):
            succs[u].append(w)
    order, ready = [], [i for i, d in enumerate(indeg) if d == 0]
    while ready:
        x = ready.pop()
        order.append(x)
        for y in succs[x]:
            indeg[y] -= 1
            if not indeg[y]:
                ready.append(y)
    anc = full_ancestors(preds, order)

    def before(a: int, b: int) -> bool:
        return bool((anc[b] >> a) & 1)

    writes = [(i, _arena(v.out, v.gpu), v.out) for i, v in enumerate(mg.vertices) if v.out.device != INPUT]
    reads = []
    for i, v in enumerate(mg.vertices):
        for r in v.ins:
            if r.src is not None:
                reads.append((pos[r.src], i, _arena(r.loc, v.gpu), r.loc))
    reads += [
        (pos[o], -1, _arena(mg.vertex(o).out, mg.vertex(o).gpu), mg.vertex(o).out)
        for o in mg.outputs.values()
    ]
    for s, r, key, loc in reads:
        if r >= 0 and not before(s, r):
            return False
        for w, wkey, out in writes:
            if w == s or wkey != key or not (out.offset < loc.end and loc.offset < out.end):
                continue
            if not before(w, s) and not (r >= 0 and before(r, w)):
                return False
    return True


def relocate(mg: MemGraph, i: int, offset: int) -> MemGraph:
    """Moves vertex i's output to `offset` on its device, and every read of it along."""
    v = mg.vertices[i]
    loc = dataclasses.replace(v.out, offset=offset)
    verts = []
    for x in mg.vertices:
        ins = tuple(dataclasses.replace(r, loc=loc) if r.src == v.id else r for r in x.ins)
        verts.append(dataclasses.replace(x, ins=ins, out=loc if x.id == v.id else x.out))
    return MemGraph(list(mg.capacity), verts, list(mg.edges), dict(mg.outputs), list(mg.host_capacity))


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("window", [2, 8, 1 << 14])
def test_verify_matches_brute_force_on_mutants(seed, window, monkeypatch):
    monkeypatch.setattr(reach_mod, "WINDOW", window)
    rng = random.Random(seed)
    tg = random_dag(rng.randint(20, 70), rng.randint(1, 3), seed, sizes=rng.choice([(32,), (16, 64)]))
    mg = build_memgraph(tg, tight_capacity(tg, rng.choice([0.0, 0.05, 0.2])), window=rng.choice([0, 64]))
    assert verify(tg, mg) == [] and brute_force_ordered(mg), f"seed {seed}: the plan itself"
    disagreements = []
    flagged = 0
    for _ in range(25):
        if rng.random() < 0.6 and mg.edges:
            k = rng.randrange(len(mg.edges))
            cut = MemGraph(
                mg.capacity, mg.vertices, mg.edges[:k] + mg.edges[k + 1 :], mg.outputs, mg.host_capacity
            )
            what = f"without edge {mg.edges[k]}"
        else:
            i = rng.randrange(len(mg.vertices))
            v = mg.vertices[i]
            if v.out.device < 0 or not any(r.src == v.id for x in mg.vertices for r in x.ins):
                continue
            top = mg.capacity[v.out.device] - v.out.nbytes
            cut = relocate(mg, i, rng.randrange(0, max(1, top + 1), 256))
            what = f"vertex {v.id} moved to {cut.vertices[i].out}"
        want = brute_force_ordered(cut)
        msgs = verify(tg, cut, limit=50)
        flagged += not want
        if want == bool(msgs):
            disagreements.append(f"{what}: brute force {'ok' if want else 'violated'}, verify {msgs[:2]}")
    assert not disagreements, f"seed {seed} window {window}: " + "; ".join(disagreements[:3])
    assert flagged, f"seed {seed}: no mutant was wrong"
