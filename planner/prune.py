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

Rejected: exact transitive reduction (ancestor sets as large as the graph: quadratic memory on a
400k-vertex plan), and checking only duplicate edges (the former statistic: 56-90% of memory
edges were implied yet kept).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .records import MEM

WINDOW = 2048  # ids; a longer edge is never dropped


class Reducer:
    """Feeds vertices in id order; keeps each edge but the implied memory edges (see the header).

    Ancestor sets are made lazily, only for vertices within the window of a memory edge's target:
    a plan whose memory edges all span W ids or more (roomy arenas reuse ranges late) costs one
    pass over its edges.
    """

    def __init__(self, window: int = WINDOW):
        self.window = W = max(0, window)
        self.mask = (1 << W) - 1
        # rings by id: the predecessors (near ones) of the last W vertices, and ancestor sets made so far
        self.near: list[list[int] | None] = [None] * max(1, W)
        self.anc: list[int | None] = [None] * max(1, W)
        self.dropped = 0

    def _ancestors(self, v: int, lo: int) -> int:
        """v's ancestors above id `lo` (bit d: v - d), made from its predecessors' on demand.

        Ids above `lo` (the window of the vertex being added) are those the rings still hold.
        """
        W, near, anc = self.window, self.near, self.anc
        if anc[v % W] is None:
            at = {v: 0}  # a post-order walk: vertex -> the next of its predecessors to look at
            stack = [v]
            while stack:
                x = stack[-1]
                ps = near[x % W]
                assert ps is not None  # x lies within the window of the vertex being added
                i = at[x]
                while i < len(ps):
                    p = ps[i]
                    i += 1
                    if p > lo and anc[p % W] is None:  # (a DAG: p is not on the stack)
                        at[x] = i
                        at[p] = 0
                        stack.append(p)
                        break
                else:
                    stack.pop()
                    s = 0
                    for p in ps:
                        if p > lo:  # older ones' bits fall outside this and every later window
                            s |= (anc[p % W] | 1) << (x - p)  # type: ignore[operator]
                    anc[x % W] = s & self.mask
        return anc[v % W]  # type: ignore[return-value]

    def add(
        self,
        w: int,
        preds: Iterable[tuple[int, str]],
        out: list[tuple[int, int, str]],
        ids: Sequence[int] | None = None,
    ) -> None:
        """Appends to `out` the edges (u, w, kind) kept of w's distinct predecessors (all u < w).

        `ids`, when given, renames each predecessor u to ids[u] first.
        """
        W = self.window
        near: list[int] = []
        test: list[tuple[int, str]] = []
        lo = w - W if W else w - 1  # predecessors above lo are near (and must lie below w)
        append = out.append
        for u, kind in preds:
            if ids is not None:
                u = ids[u]
            if u > lo:  # (the usual memory edge of a roomy plan is far: one comparison)
                if u >= w:
                    raise ValueError(f"edge {u} -> {w} does not point forward")
                if W:
                    near.append(u)
                    if kind == MEM:
                        test.append((u, kind))
                        continue
            append((u, w, kind))
        if not W:
            return
        self.near[w % W] = near
        self.anc[w % W] = None
        if not test:
            return
        s = 0
        for p in near:
            s |= self._ancestors(p, w - W) << (w - p)
        for u, kind in test:
            if (s >> (w - u)) & 1:
                self.dropped += 1
            else:
                out.append((u, w, kind))


def reduce_edges(
    preds: Sequence[list[tuple[int, str]]], window: int = WINDOW
) -> tuple[list[tuple[int, int, str]], int]:
    """The edges (u, w, kind) left after dropping implied memory edges, and how many were dropped.

    Args:
        preds: per vertex id w (0..n-1, a topological order), its distinct predecessors (u, kind), u < w.
        window: the span below which implication is detected (0: drop nothing).
    """
    r = Reducer(window)
    out: list[tuple[int, int, str]] = []
    for w, ps in enumerate(preds):
        r.add(w, ps, out)
    return out, r.dropped
