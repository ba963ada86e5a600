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

from disco_ray.graph.taskgraph import Kind, TaskGraph

from .capacity import aligned, capacities
from .order import check_order, default_order

INF = float("inf")


def min_reload_bytes(
    tg: TaskGraph,
    capacity: int | Sequence[int] | Mapping[int, int],
    order: Sequence[str] | None = None,
    alignment: int = 256,
) -> list[int]:
    """Per GPU, the least reload bytes of any plan of `tg` in `order` (default: `default_order`).

    Values take their aligned size, arenas their capacity rounded down to the alignment (as the
    planner's). Exact (Belady's MIN) when all values are one size; a lower bound otherwise.
    """
    caps = [c // alignment * alignment for c in capacities(capacity, tg.gpus)]
    seq = default_order(tg, caps) if order is None else check_order(tg, order)
    n = len(seq)
    V = tg.vertices
    size = {v.id: aligned(v.nbytes, alignment) for v in tg}
    uses: dict[str, list[int]] = {x: [] for x in seq}
    for t, vid in enumerate(seq):
        for i in dict.fromkeys(V[vid].inputs):
            uses[i].append(t)
    kept = set(tg.kept)
    nxt = dict.fromkeys(seq, 0)
    resident: list[dict[str, int]] = [{} for _ in caps]  # value -> bytes of it in the arena
    used = [0] * tg.gpus
    heaps: list[list[tuple[float, str]]] = [[] for _ in caps]  # (-next request, value), lazy
    reloaded = [0] * tg.gpus

    def when(x: str) -> float:
        k = nxt[x]
        if k < len(uses[x]):
            return uses[x][k]
        if x in kept:
            return n if V[x].kind is Kind.INPUT else INF
        return -1.0  # dead

    def request(g: int, xs: list[str], t: int) -> None:
        res = resident[g]
        need = sum(size[x] - res.get(x, 0) for x in xs)
        over = used[g] + need - caps[g]
        pinned = set(xs)
        held = []
        h = heaps[g]
        while over > 0:
            key, x = heapq.heappop(h)
            have = res.get(x, 0)
            if not have or -key != when(x):
                continue  # stale entry
            if x in pinned:
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
            have = res.get(x, 0)
            if have < size[x]:
                if x != seq[t]:
                    reloaded[g] += size[x] - have
                used[g] += size[x] - have
                res[x] = size[x]

    def settle(g: int, x: str) -> None:
        w = when(x)
        if w < 0:
            used[g] -= resident[g].pop(x, 0)
        elif resident[g].get(x):
            heapq.heappush(heaps[g], (-w, x))

    for t, vid in enumerate(seq):
        v = V[vid]
        ops = list(dict.fromkeys(v.inputs))
        if v.kind is Kind.TRANSFER:
            request(V[ops[0]].gpu, ops, t)
            request(v.gpu, [vid], t)
        else:
            request(v.gpu, [*ops, vid], t)
        for x in ops:
            nxt[x] += 1
            settle(V[x].gpu, x)
        settle(v.gpu, vid)
    for x in kept:  # a kept input evicted along the way comes back at the end
        if V[x].kind is Kind.INPUT:
            g = V[x].gpu
            reloaded[g] += size[x] - resident[g].get(x, 0)
    return reloaded
