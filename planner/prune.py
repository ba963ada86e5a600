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

from collections.abc import Sequence

from .records import MEM

WINDOW = 2048  # ids; a longer edge is never dropped


class Reducer:
    """Feeds vertices in id order; keeps each edge but the implied memory edges (see the header)."""

    def __init__(self, window: int = WINDOW):
        self.window = max(0, window)
        self.mask = (1 << self.window) - 1
        self.anc = [0] * max(1, self.window)  # ring: anc[u % window] = ancestors of u, bit d = u - d
        self.dropped = 0

    def add(self, w: int, preds: list[tuple[int, str]], out: list[tuple[int, int, str]]) -> None:
        """Appends to `out` the edges (u, w, kind) kept of w's distinct predecessors (all u < w)."""
        W, anc = self.window, self.anc
        s = 0
        near = []
        for e in preds:
            d = w - e[0]
            if d >= W:
                out.append((e[0], w, e[1]))  # too long to tell: kept
            elif d > 0:
                near.append(e)
                a = anc[e[0] % W]
                if a:
                    s |= a << d
            else:
                raise ValueError(f"edge {e[0]} -> {w} does not point forward")
        own = 0
        for u, kind in near:
            d = w - u
            if kind == MEM and (s >> d) & 1:
                self.dropped += 1
            else:
                own |= 1 << d
                out.append((u, w, kind))
        if W:
            anc[w % W] = (s | own) & self.mask


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
