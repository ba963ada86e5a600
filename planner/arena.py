"""Byte-range allocator of one simulated arena (a GPU's, or a host store) with overwrite history.

Blocks tile [0, capacity) in offset order. A free block remembers the *ghosts* of what lay there
before: (lo, hi, time, readers), the vertices that must finish before anything overwrites that
range. Allocating over a ghost returns its readers, from which the planner adds the memory
dependency edges of TURNIP section 4 ("v1 safely overwrites v2"). An allocation keeps the ghosts it
covered, so retracting it restores the arena exactly.

Free-range choice (TURNIP section 6): among places that fit, the one whose newest ghost is oldest
(the range whose last use lies furthest in the past), ties to the tighter fit. A host store
(capacity None) grows at its top when no free range fits, and records its peak.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from typing import Protocol, cast

import numpy as np

from .capacity import aligned

Ghost = tuple[int, int, int, tuple[int, ...]]  # lo, hi, time, readers
NEVER = -1
_INF = float("inf")
_FAR = 1e300  # the distance of an owner nobody reads again: farthest, yet evicting it moves bytes


MAX_GHOSTS = 16  # per free block; beyond it the oldest neighbours merge (more, older, memory edges)


def _bounded(ghosts: list[Ghost]) -> list[Ghost]:
    """Merges adjacent ghosts, oldest pair first, until at most MAX_GHOSTS remain.

    A merged ghost spans both ranges and keeps both reader sets: a later writer of either part
    then waits for all of them. That only adds edges from vertices the simulation has already
    run, so the MemGraph stays correct and acyclic; it bounds the cost of every allocation.
    """
    while len(ghosts) > MAX_GHOSTS:
        k = min(range(len(ghosts) - 1), key=lambda i: max(ghosts[i][2], ghosts[i + 1][2]))
        a, b = ghosts[k], ghosts[k + 1]
        merged = (a[0], b[1], max(a[2], b[2]), tuple(dict.fromkeys(a[3] + b[3])))
        ghosts[k : k + 2] = [merged]
    return ghosts


def _range_min(a: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """min(a[lo[k]:hi[k]]) for every k (hi > lo), by a sparse table: O(n log n) in numpy."""
    n = len(a)
    length = hi - lo
    levels = int(length.max()).bit_length()
    table = np.full((levels, n), _INF)
    table[0] = a
    for k in range(1, levels):
        span = 1 << (k - 1)
        table[k, : n - span] = np.minimum(table[k - 1, : n - span], table[k - 1, span:])
    level = np.log2(length).astype(np.int64)
    return np.minimum(table[level, lo], table[level, hi - (1 << level)])


class Victim(Protocol):
    """What `best_window` reads of an owner (the planner's Inst)."""

    @property
    def dist(self) -> float: ...
    @property
    def off(self) -> int: ...


class Block:
    __slots__ = ("ghosts", "newest", "off", "owner", "size")

    def __init__(self, off: int, size: int, owner: object = None, ghosts: list[Ghost] | None = None):
        self.off = off
        self.size = size
        self.owner = owner  # None: free
        self.ghosts = ghosts if ghosts is not None else []  # free: what lay here; allocated: what it covered
        # a free block's last use of any byte (unused while allocated)
        self.newest = NEVER if owner is not None else max((g[2] for g in self.ghosts), default=NEVER)

    @property
    def end(self) -> int:
        return self.off + self.size

    def __repr__(self) -> str:
        return f"Block({self.off}+{self.size}, {'free' if self.owner is None else self.owner})"


def _clip(ghosts: list[Ghost], lo: int, hi: int) -> list[Ghost]:
    """The ghosts overlapping [lo, hi), cut to it (most lie wholly inside or outside: kept as they are)."""
    return [
        g if lo <= g[0] and g[1] <= hi else (g[0] if g[0] > lo else lo, g[1] if g[1] < hi else hi, g[2], g[3])
        for g in ghosts
        if g[0] < hi and g[1] > lo
    ]


def _newest(ghosts: list[Ghost], lo: int, hi: int) -> int:
    return max([g[2] for g in ghosts if g[0] < hi and g[1] > lo], default=NEVER)


class Arena:
    def __init__(self, capacity: int | None, alignment: int = 256):
        self.align = alignment
        # None: unbounded (a host store); a tail smaller than the alignment is never used
        self.capacity = None if capacity is None else capacity // alignment * alignment
        self.blocks: list[Block] = [Block(0, self.capacity)] if self.capacity else []
        self.free: set[Block] = set(self.blocks)
        # kept in step with blocks: offsets for bisect, owners for the vectorised window search
        self.offs: list[int] = [b.off for b in self.blocks]
        self.owner_at: list[object] = [None for _ in self.blocks]
        self.releases = 0  # bumps on every release: a failed best_free stays failed until it moves
        self.used = 0
        self.peak = 0

    def round(self, nbytes: int) -> int:
        return aligned(nbytes, self.align)

    @property
    def top(self) -> int:
        return self.blocks[-1].end if self.blocks else 0

    def _find(self, off: int) -> int:
        """Index of the block holding byte `off`."""
        return bisect_right(self.offs, off) - 1

    # ---- allocation ---------------------------------------------------------------------------
    def best_free(self, size: int) -> int | None:
        """Offset of the best free place for `size` bytes, or None (a host store: None never)."""
        best = None
        for b in self.free:
            if b.size >= size:
                score = (b.newest, b.size, b.off)
                if best is None or score < best[0]:
                    best = (score, b)
        if best is not None:
            b = best[1]
            if b.size > size and _newest(b.ghosts, b.end - size, b.end) < _newest(
                b.ghosts, b.off, b.off + size
            ):
                return b.end - size
            return b.off
        if self.capacity is None:
            last = self.blocks[-1] if self.blocks else None
            return last.off if last is not None and last.owner is None else self.top
        return None

    def take(self, off: int, size: int, owner: object) -> list[Ghost]:
        """Allocates [off, off+size) (which must be free) to `owner`; returns the ghosts it covers."""
        if self.capacity is None and off + size > self.top:
            if self.blocks and self.blocks[-1].owner is None:
                self.blocks[-1].size = off + size - self.blocks[-1].off
            else:
                self.blocks.append(Block(self.top, off + size - self.top))
                self.offs.append(self.blocks[-1].off)
                self.owner_at.append(None)
                self.free.add(self.blocks[-1])
        i = self._find(off)
        b = self.blocks[i]
        if b.owner is not None or b.end < off + size:
            raise AssertionError(f"take({off}, {size}) over {b}")
        free = self.free
        free.discard(b)
        end = off + size
        ghosts = b.ghosts
        covered = _clip(ghosts, off, end) if ghosts else []
        mid = Block(off, size, owner, covered)
        new = [mid]
        if b.off < off:
            left = Block(b.off, off - b.off, None, _clip(ghosts, b.off, off) if ghosts else None)
            new.insert(0, left)
            free.add(left)
        if end < b.end:
            right = Block(end, b.end - end, None, _clip(ghosts, end, b.end) if ghosts else None)
            new.append(right)
            free.add(right)
        self.blocks[i : i + 1] = new
        self.offs[i : i + 1] = [x.off for x in new]
        self.owner_at[i : i + 1] = [x.owner for x in new]
        self.used += size
        if self.used > self.peak:
            self.peak = self.used
        return covered

    def release(self, off: int, readers: tuple[int, ...] | None, time: int) -> None:
        """Frees the block at `off`. readers None: a retraction, restoring the ghosts it covered."""
        i = self._find(off)
        b = self.blocks[i]
        assert b.off == off and b.owner is not None, (off, b)
        self.used -= b.size
        self.releases += 1
        b.owner = None
        self.owner_at[i] = None
        if readers is not None:
            b.ghosts = [(b.off, b.end, time, readers)]
            b.newest = time
        else:
            b.newest = max((g[2] for g in b.ghosts), default=NEVER)
        self.free.add(b)
        # coalesce with free neighbours
        if i + 1 < len(self.blocks) and self.blocks[i + 1].owner is None:
            nxt = self.blocks.pop(i + 1)
            self.offs.pop(i + 1)
            self.owner_at.pop(i + 1)
            self.free.discard(nxt)
            b.size += nxt.size
            b.ghosts = _bounded(b.ghosts + nxt.ghosts)
            b.newest = max(b.newest, nxt.newest)
        if i > 0 and self.blocks[i - 1].owner is None:
            prev = self.blocks[i - 1]
            self.free.discard(b)
            prev.size += b.size
            prev.ghosts = _bounded(prev.ghosts + b.ghosts)
            prev.newest = max(prev.newest, b.newest)
            self.blocks.pop(i)
            self.offs.pop(i)
            self.owner_at.pop(i)

    # ---- eviction -----------------------------------------------------------------------------
    def best_window(
        self, size: int, pinned: Mapping[int, Victim], at: int | None = None
    ) -> tuple[int, list[Block]] | None:
        """The window of `size` bytes whose evicted owners' minimum distance is largest.

        An owner's `dist` is its distance to its next use; owners whose id() is in `pinned` may not
        move (`pinned` maps id() to owner). Ties go to
        fewer evicted bytes, then the lower offset. `at` forces the window's offset. Returns
        (offset, owner blocks to evict) or None when every window holds an owner that may not move.
        Windows start at block starts; numpy does every window at once (a sparse-table range minimum).
        """
        blocks = self.blocks
        capacity = self.capacity
        assert capacity is not None  # a GPU arena: host stores grow instead
        if at is not None:
            i = self._find(at)
            j = i
            victims = []
            while j < len(blocks) and blocks[j].off < at + size:
                if blocks[j].owner is not None:
                    if id(blocks[j].owner) in pinned:
                        return None
                    victims.append(blocks[j])
                j += 1
            return (at, victims) if at + size <= capacity else None
        offs = np.array(self.offs, dtype=np.int64)
        # per block: its owner's distance (inf: free; _FAR: an owner never used again; -1: may not move)
        owner_at = cast("list[Victim | None]", self.owner_at)  # every owner here is one
        keys = np.array([_INF if o is None else o.dist for o in owner_at], dtype=np.float64)
        owned = keys < _INF
        keys[keys == _INF] = _FAR
        keys[~owned] = _INF
        for o in pinned.values():
            i = bisect_right(self.offs, o.off) - 1
            if self.owner_at[i] is o:
                keys[i] = -1.0
        moves = np.empty_like(offs)
        moves[:-1] = offs[1:] - offs[:-1]
        moves[-1] = self.top - offs[-1]
        moves *= owned
        starts = np.flatnonzero(offs + size <= capacity)
        if not len(starts):
            return None
        ends = np.searchsorted(offs, offs[starts] + size)  # window i covers blocks [i, ends)
        blocked = np.concatenate(([0], np.cumsum(keys < 0)))
        ok = blocked[ends] == blocked[starts]
        starts, ends = starts[ok], ends[ok]
        if not len(starts):
            return None
        kmin = _range_min(keys, starts, ends)
        moved = np.concatenate(([0], np.cumsum(moves)))
        moved = moved[ends] - moved[starts]
        # the farthest minimum distance, then the fewest bytes moved, then the lowest offset
        far = np.flatnonzero(kmin == kmin.max())
        best = far[np.argmin(moved[far])]
        i, j = int(starts[best]), int(ends[best])
        return self.offs[i], [b for b in blocks[i:j] if b.owner is not None]

    def owners(self) -> list[object]:
        return [b.owner for b in self.blocks if b.owner is not None]
