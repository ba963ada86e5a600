"""Windowed transitive reduction: drops memory edges that other paths already imply (TURNIP section 6).

BUILDMEMGRAPH adds an edge from every reader of what lay in a range to the range's next writer;
most of them are implied (the next writer already depends on a later reader of the same value, or
on a vertex that waited for it). An implied edge constrains nothing, yet each costs the runtime a
dependency count and, across GPUs, a coordinator message. A memory edge u -> w is dropped when u
is an ancestor of another predecessor of w. Ancestors are kept as bit sets relative to the vertex
(bit d: the vertex d ids earlier) over a window of the W previous ids, built in id order (ids are
a topological order) with Python's big-int shift and or: exact for spans below W, and an edge of
a longer span is kept (safe: an extra edge never makes a plan wrong). Dropping any set of edges
each implied by a path of the original graph keeps its reachability (induction on span), so the
plan's partial order, and every verification result, is unchanged. Data edges stay: they are the
TaskGraph's own dependencies (FORMATS.md keeps them all).

The edges come as columns (numpy arrays); only the targets of memory edges shorter than the
window are looked at, one by one, and ancestor sets are made lazily for the vertices their windows
reach: a plan whose memory edges all span W ids or more (roomy arenas reuse ranges late) costs a
few array operations.

Rejected: exact transitive reduction (ancestor sets as large as the graph: quadratic memory on a
400k-vertex plan), and checking only duplicate edges (which left them: 56-90% of memory
edges were implied yet kept).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from disco_ray.graph.memgraph import edge_columns

WINDOW = 2048  # ids; a longer edge is never dropped


def reduce_columns(
    u: np.ndarray, w: np.ndarray, mem: np.ndarray, n: int, window: int = WINDOW
) -> tuple[np.ndarray | None, int]:
    """The edges (u[i], w[i]) kept, as indices in their order (None: all, as they are), and how
    many were dropped.

    The edges come sorted by target w (each target's predecessors in their own order), every u < w;
    `mem` marks memory edges, `n` is the number of vertices. Kept edges keep that order, except
    that a target's tested memory edges (spans below the window) come after its others.

    Raises:
        ValueError: an edge that does not point forward.
    """
    bad = np.flatnonzero(u >= w)
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"edge {int(u[i])} -> {int(w[i])} does not point forward")
    W = max(0, window)
    if not W:
        return None, 0
    tested = (u > w - W) & mem
    if not tested.any():  # (the usual roomy plan: every memory edge is far)
        return None, 0
    at = np.searchsorted(w, np.arange(n + 1)).tolist()  # the edges of target x: at[x]:at[x + 1]
    us, test = u.tolist(), tested.tolist()
    mask = (1 << W) - 1
    anc: dict[int, int] = {}  # vertex -> its ancestors above the first window that asked (bit d: x - d)

    def near(x: int) -> list[int]:
        return [p for p in us[at[x] : at[x + 1]] if p > x - W]

    def ancestors(v: int, lo: int) -> int:
        """v's ancestors above `lo` (a post-order walk; exact for every later window too)."""
        if v not in anc:
            todo: dict[int, list[int]] = {v: near(v)}
            stack = [v]
            while stack:
                x = stack[-1]
                for p in todo[x]:
                    if p > lo and p not in anc and p not in todo:  # (a DAG: p is not on the stack)
                        todo[p] = near(p)
                        stack.append(p)
                        break
                else:
                    stack.pop()
                    bits = 0
                    for p in todo.pop(x):
                        if p > lo:  # older ones' bits fall outside this and every later window
                            bits |= (anc[p] | 1) << (x - p)
                    anc[x] = bits & mask
        return anc[v]

    drop = []
    for x in np.unique(w[tested]).tolist():  # ascending
        lo = x - W
        if len(anc) > 4 * W:  # forget vertices no later window reaches
            anc = {k: v for k, v in anc.items() if k > lo}
        s = 0
        for p in near(x):
            s |= ancestors(p, lo) << (x - p)
        for i in range(at[x], at[x + 1]):
            if test[i] and (s >> (x - us[i])) & 1:
                drop.append(i)
    keep = np.ones(len(u), dtype=bool)
    keep[drop] = False
    order = np.lexsort((tested, w))  # by target, a target's tested edges last (a stable sort)
    return order[keep[order]], len(drop)


def reduce_edges(
    preds: Sequence[list[tuple[int, str]]], window: int = WINDOW
) -> tuple[list[tuple[int, int, str]], int]:
    """The edges (u, w, kind) left after dropping implied memory edges, and how many were dropped.

    Args:
        preds: per vertex id w (0..n-1, a topological order), its distinct predecessors (u, kind), u < w.
        window: the span below which implication is detected (0: drop nothing).
    """
    edges = [(u, w, k) for w, ps in enumerate(preds) for u, k in ps]
    u, w, mem = edge_columns(edges)
    order, dropped = reduce_columns(u, w, mem, len(preds), window)
    return edges if order is None else [edges[i] for i in order.tolist()], dropped
