"""The fewest reload bytes any plan of a TaskGraph can have for a given serial order: Belady's MIN.

Each GPU's arena is a cache of values; executing V[t] requests its operands and its output on
their GPUs at once. A value missing when requested is reloaded, except the output, which is
produced, and a graph input's first load (both compulsory for every plan). Belady (1966): evicting
the resident value whose next request lies furthest ahead misses least. A value nobody requests
again is dropped for free, except what the plan must keep (TaskGraph.kept): a kept value computed
on a GPU may stay on the host once offloaded, so its next request is "never", while a kept graph
input must be back in its arena at the end, a request at time n.

Here every byte is its own cache line, so values may be evicted in part (fractional eviction in
the bit model: cost = bytes). That relaxes the real problem, where a value moves whole and lies
at one offset, so it is a lower bound on any plan's reload bytes for the order; when every value
takes the same number of bytes and the capacity is a whole number of them, evicting whole values
is optimal and the bound is exactly the MIN that the planner must reach. Rejected: an ILP over
eviction times (exact for variable sizes, but NP-hard: far too slow for real graphs).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np

from disco_ray.graph.taskgraph import Kind, TaskGraph

from .capacity import capacities
from .dense import Dense, check_order

INF = float("inf")


def min_reload_bytes(
    tg: TaskGraph,
    capacity: int | Sequence[int] | Mapping[int, int],
    order: Sequence[str],
    alignment: int = 256,
) -> list[int]:
    """Per GPU, the least reload bytes of any plan of `tg` in `order` (e.g. `planner.default_order`).

    Values take their aligned size, arenas their capacity rounded down to the alignment (as the
    planner's). Exact (Belady's MIN) when all values are one size; a lower bound otherwise.
    """
    d = Dense(tg)
    seq = [d.index[x] for x in check_order(tg, order)]
    return reload_bound(d, seq, capacities(capacity, tg.gpus), alignment)


def peak_live(d: Dense, seq: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """Per GPU, the most bytes live at once in order `seq` when nothing is evicted (kept values stay).

    A value is live from its own step through its last reader's (to the end if kept).
    """
    n = len(seq)
    pos = np.empty(n, dtype=np.int64)
    pos[np.asarray(seq, dtype=np.int64)] = np.arange(n, dtype=np.int64)
    off, flat = d.csr()
    last = pos.copy()
    reader = np.repeat(np.arange(n, dtype=np.int64), np.diff(off))
    np.maximum.at(last, flat, pos[reader])
    if d.kept:
        last[np.asarray(d.kept, dtype=np.int64)] = n
    size = np.asarray(sizes, dtype=np.int64)
    gpu = np.asarray(d.gpu, dtype=np.int64)
    peaks = []
    for g in range(d.gpus):
        mine = gpu == g
        delta = np.zeros(n + 2, dtype=np.int64)
        np.add.at(delta, pos[mine], size[mine])
        np.add.at(delta, last[mine] + 1, -size[mine])
        peaks.append(int(np.cumsum(delta).max(initial=0)))
    return peaks


def reload_bound(d: Dense, seq: Sequence[int], caps: Sequence[int], alignment: int = 256) -> list[int]:
    """`min_reload_bytes` on a flattened graph, `seq` its vertex-list positions in serial order."""
    caps = [c // alignment * alignment for c in caps]
    sizes = d.sizes(alignment)
    if all(p <= c for p, c in zip(peak_live(d, seq, sizes), caps)):
        return [0] * d.gpus  # everything fits at once: nothing is ever evicted
    n = len(seq)
    uses: list[list[int]] = [[] for _ in range(n)]
    for t, k in enumerate(seq):
        for i in d.operands[k]:
            uses[i].append(t)
    kept = set(d.kept)
    gpu, kind = d.gpu, d.kind
    nxt = [0] * n
    resident: list[dict[int, int]] = [{} for _ in caps]  # value -> bytes of it in the arena
    used = [0] * d.gpus
    heaps: list[list[tuple[float, int]]] = [[] for _ in caps]  # (-next request, value), lazy
    reloaded = [0] * d.gpus

    def when(x: int) -> float:
        i = nxt[x]
        if i < len(uses[x]):
            return uses[x][i]
        if x in kept:
            return n if kind[x] is Kind.INPUT else INF
        return -1.0  # dead

    def request(g: int, xs: Sequence[int], out: int) -> None:
        res = resident[g]
        over = used[g] + sum(sizes[x] - res.get(x, 0) for x in xs) - caps[g]
        held = []
        h = heaps[g]
        while over > 0 and h:  # empty: an accumulate whose operands fit only one at a time (sum-into)
            key, x = heapq.heappop(h)
            have = res.get(x, 0)
            if not have or -key != when(x):
                continue  # stale entry
            if x in xs:
                held.append((key, x))
                continue
            take = min(have, over)
            over -= take
            used[g] -= take
            if take == have:
                del res[x]
            else:
                res[x] = have - take
                heapq.heappush(h, (key, x))
        for e in held:
            heapq.heappush(h, e)
        for x in xs:
            missing = sizes[x] - res.get(x, 0)
            if missing:
                if x != out:
                    reloaded[g] += missing
                used[g] += missing
                res[x] = sizes[x]

    def settle(g: int, x: int) -> None:
        w = when(x)
        if w < 0:
            used[g] -= resident[g].pop(x, 0)
        elif resident[g].get(x):
            heapq.heappush(heaps[g], (-w, x))

    for k in seq:
        ops = d.operands[k]
        if kind[k] is Kind.TRANSFER:
            request(gpu[ops[0]], ops, k)
            request(gpu[k], (k,), k)
        else:
            request(gpu[k], (*ops, k), k)
        for x in ops:
            nxt[x] += 1
            settle(gpu[x], x)
        settle(gpu[k], k)
    for x in kept:  # a kept input evicted along the way comes back at the end
        if kind[x] is Kind.INPUT:
            reloaded[gpu[x]] += sizes[x] - resident[gpu[x]].get(x, 0)
    return reloaded
