"""Ghosts: what lay in a free range of an arena (planner.arena) before, and who read it.

A ghost is (lo, hi, time, readers): the vertices that must finish before anything overwrites
[lo, hi) (TURNIP section 4, "v1 safely overwrites v2"), `time` the step of its last use. A free
block keeps the ghosts of its range, at most MAX_GHOSTS; an allocation takes those it covers.
"""

from __future__ import annotations

Ghost = tuple[int, int, int, tuple[int, ...]]  # lo, hi, time, readers
NEVER = -1
MAX_GHOSTS = 16  # per free block; beyond it the oldest neighbours merge (more, older, memory edges)


def bounded(ghosts: list[Ghost]) -> list[Ghost]:
    """Merges neighbouring ghosts pairwise until at most MAX_GHOSTS remain.

    A merged ghost spans both ranges and keeps both reader sets: a later writer of either part
    then waits for all of them. That only adds edges from vertices the simulation has already
    run, so the MemGraph stays correct and acyclic; it bounds the cost of every allocation.
    """
    while len(ghosts) > MAX_GHOSTS:
        merged = []
        for i in range(0, len(ghosts) - 1, 2):
            a, b = ghosts[i], ghosts[i + 1]
            merged.append((a[0], b[1], a[2] if a[2] > b[2] else b[2], tuple(dict.fromkeys(a[3] + b[3]))))
        if len(ghosts) % 2:
            merged.append(ghosts[-1])
        ghosts = merged
    return ghosts


def clip(ghosts: list[Ghost], lo: int, hi: int) -> list[Ghost]:
    """The ghosts overlapping [lo, hi), cut to it (most lie wholly inside or outside: kept as they are)."""
    return [
        g if lo <= g[0] and g[1] <= hi else (g[0] if g[0] > lo else lo, g[1] if g[1] < hi else hi, g[2], g[3])
        for g in ghosts
        if g[0] < hi and g[1] > lo
    ]


def cut_at(ghosts: list[Ghost], cut: int) -> tuple[list[Ghost], list[Ghost], int]:
    """`clip` below and above one offset in one pass: (below, above, newest time above)."""
    below: list[Ghost] = []
    above: list[Ghost] = []
    newest = NEVER
    for g in ghosts:
        if g[0] < cut:
            below.append(g if g[1] <= cut else (g[0], cut, g[2], g[3]))
        if g[1] > cut:
            above.append(g if g[0] >= cut else (cut, g[1], g[2], g[3]))
            if g[2] > newest:
                newest = g[2]
    return below, above, newest


def top_is_older(ghosts: list[Ghost], lo: int, hi: int, size: int) -> bool:
    """Whether the last use of [hi - size, hi) is older than that of [lo, lo + size)."""
    a = b = NEVER
    bottom, top = lo + size, hi - size
    for g in ghosts:
        if g[0] < bottom and g[2] > a:
            a = g[2]
        if g[1] > top and g[2] > b:
            b = g[2]
    return b < a
