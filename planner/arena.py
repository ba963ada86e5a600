"""Byte-range allocator of one simulated arena (a GPU's, or a host store) with overwrite history.

Blocks tile [0, capacity) in offset order. A free block remembers the *ghosts* of what lay there
before: (lo, hi, time, readers), the vertices that must finish before anything overwrites that
range. Allocating over a ghost returns its readers, from which the planner adds the memory
dependency edges of TURNIP section 4 ("v1 safely overwrites v2"). An allocation keeps the ghosts it
covered, so retracting it restores the arena exactly (planner.ghosts: cutting, clipping and
merging them).

Free-range choice (TURNIP section 6), `fit`: "oldest" takes, among free blocks that fit, the one
whose newest ghost is oldest (its last use lies furthest in the past: the weakest memory edges),
ties to the tighter fit; "best" takes the tightest fit (least fragmentation), ties to the oldest;
"fewest" the one whose ghosts name the fewest readers (fewest new memory edges), ties to the
oldest. The planner's default, "oldest", is chosen by simulated makespan (benchmarks/
bench_quality.py: fastest without memory pressure, "best" sometimes ahead under it). Within the
chosen block the end whose ghosts are older is used. Free blocks are indexed per size class (bit
length) in lists sorted by the choice's key, so a choice looks at one class's blocks and the first
of each larger class, not at every free block (a scan of them all cost 20 us per allocation on a
fragmented 65B plan). A host store or spill file (capacity None) grows at its top when no free range
fits, and records its peak; a host store with a budget is bounded like a GPU arena.

Victims (`best_window`, TURNIP section 6 "simMallocOffld"): the window of blocks whose owners'
smallest key is largest. A key orders victims: an output reserved and not computed yet is undone
first (it moves nothing; the later its position, the better), then a kept value nobody reads
again (it moves to the host and stays there), then live values by their next use, furthest first
(Belady's MIN for one slot size). Free space beats everything; a pinned owner may not move.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator, Mapping
from typing import Protocol, cast

import numpy as np

from .capacity import aligned
from .ghosts import MAX_GHOSTS, NEVER, Ghost, bounded, clip, cut_at, top_is_older

_INF = float("inf")
RESERVED = 1e15  # key base of a reserved, unproduced output: undoing it moves nothing
DONE = 1e14  # key of a kept value nobody reads again (its owner's dist is inf)
FITS = ("oldest", "best", "fewest")


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
    """A byte range of an arena, free (owner None) or allocated; blocks form a list in offset order."""

    __slots__ = ("cls", "ghosts", "key", "newest", "next", "off", "owner", "prev", "size")

    def __init__(self, off: int, size: int, owner: object = None, ghosts: list[Ghost] | None = None):
        self.off = off
        self.size = size
        self.owner = owner  # None: free
        self.ghosts = ghosts if ghosts is not None else []  # free: what lay here; allocated: what it covered
        # a free block's last use of any byte (unused while allocated)
        self.newest = max([g[2] for g in ghosts]) if ghosts and owner is None else NEVER
        self.prev: Block | None = None
        self.next: Block | None = None
        self.key: tuple = ()  # its key in the free index while free
        self.cls = 0

    @property
    def end(self) -> int:
        return self.off + self.size

    def __repr__(self) -> str:
        return f"Block({self.off}+{self.size}, {'free' if self.owner is None else self.owner})"


class Arena:
    def __init__(self, capacity: int | None, alignment: int = 256, fit: str = "oldest"):
        if fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
        self.align = alignment
        self.fit = fit
        self.oldest = fit != "best"  # "fewest" scans like "oldest", by its own key
        # None: unbounded (a host store); a tail smaller than the alignment is never used
        self.capacity = None if capacity is None else capacity // alignment * alignment
        self.head: Block | None = None
        self.tail: Block | None = None
        # the free blocks' index: per size class (bit length), a sorted list of keys, (newest, size,
        # off, block) for "oldest" or (size, newest, off, block) for "best" (offsets differ: the
        # block itself is never compared)
        self.classes: dict[int, list[tuple]] = {}
        self.nonempty: list[int] = []  # size classes with a free block, ascending
        if self.capacity:
            self.head = self.tail = Block(0, self.capacity)
            self._free_add(self.head)
        self.releases = 0  # bumps on every release: a failed best_free stays failed until it moves
        self.used = 0
        self.peak = 0
        self.high = 0  # the highest end of any range allocated (the bytes a store needs)

    def round(self, nbytes: int) -> int:
        return aligned(nbytes, self.align)

    @property
    def top(self) -> int:
        return self.tail.off + self.tail.size if self.tail is not None else 0

    def blocks(self) -> Iterator[Block]:
        """The blocks in offset order."""
        b = self.head
        while b is not None:
            yield b
            b = b.next

    def block_at(self, off: int) -> Block:
        """The block holding byte `off` (a walk: for the rare paths)."""
        for b in self.blocks():
            if b.off <= off < b.off + b.size:
                return b
        raise AssertionError(f"no block holds byte {off}")

    # ---- the free index -------------------------------------------------------------------------
    def _free_add(self, b: Block) -> None:
        key: tuple
        if self.oldest:
            if self.fit == "oldest":
                key = (b.newest, b.size, b.off, b)
            else:
                key = (sum([len(g[3]) for g in b.ghosts]), b.newest, b.size, b.off, b)
        else:
            key = (b.size, b.newest, b.off, b)
        b.key = key
        b.cls = c = b.size.bit_length()
        lst = self.classes.get(c)
        if lst is None:
            self.classes[c] = [key]
            insort(self.nonempty, c)
        else:
            insort(lst, key)

    def _free_remove(self, b: Block) -> None:
        lst = self.classes[b.cls]
        if len(lst) == 1:
            del self.classes[b.cls]
            del self.nonempty[bisect_left(self.nonempty, b.cls)]
        else:
            del lst[bisect_left(lst, b.key)]
        b.key = ()  # (the key names the block: no cycle left behind)

    # ---- allocation ---------------------------------------------------------------------------
    def best_free(self, size: int) -> tuple[Block | None, int] | None:
        """(free block, offset in it) of the best place for `size` bytes, or None.

        A host store never answers None: (None, top) means "grow at the top".
        """
        classes, nonempty = self.classes, self.nonempty
        c = size.bit_length()  # classes above c hold only blocks larger than size
        best = None
        if self.capacity is not None and (not nonempty or c > nonempty[-1]):
            return None  # every free block is smaller (the usual failure of a blocked horizon)
        lst = classes.get(c)
        if self.oldest:
            if lst:
                at = 1 if self.fit == "oldest" else 2  # the size's place in the key
                for key in lst:
                    if key[at] >= size:
                        best = key
                        break
            for above in nonempty[bisect_right(nonempty, c) :]:
                key = classes[above][0]
                if best is None or key < best:
                    best = key
        else:
            if lst:
                j = bisect_left(lst, (size,))
                if j < len(lst):
                    best = lst[j]
            if best is None:
                i = bisect_right(nonempty, c)
                if i < len(nonempty):
                    best = classes[nonempty[i]][0]
        if best is not None:
            b = best[-1]
            if b.size > size and b.ghosts and top_is_older(b.ghosts, b.off, b.off + b.size, size):
                return b, b.off + b.size - size
            return b, b.off
        if self.capacity is None:
            last = self.tail
            return (last, last.off) if last is not None and last.owner is None else (None, self.top)
        return None

    def take(self, b: Block | None, off: int, size: int, owner: object) -> tuple[Block, list[Ghost]]:
        """Allocates [off, off+size) of free block `b` to `owner`: (its block, the ghosts it covers).

        `b` None (a host store): a new block at the top.
        """
        end = off + size
        if b is None or b.off + b.size < end:  # a host store grows at its top
            assert self.capacity is None, (b, off, size)
            if b is None:
                b = Block(self.top, end - self.top)
                self._link_after(self.tail, b)
            else:
                self._free_remove(b)
                b.size = end - b.off
            self._free_add(b)
        if b.owner is not None or b.off > off:
            raise AssertionError(f"take({off}, {size}) over {b}")
        self._free_remove(b)
        ghosts = b.ghosts
        bend = b.off + b.size
        if b.off == off and bend == end:  # an exact fit: the block itself is taken
            b.owner = owner
            mid = b
            covered = ghosts
        elif b.off == off:  # the bottom of b (the usual split): b becomes the part above
            mid = Block(off, size, owner)
            if ghosts:
                mid.ghosts, b.ghosts, b.newest = cut_at(ghosts, end)
            covered = mid.ghosts
            self._link_after(b.prev, mid)
            b.off = end
            b.size = bend - end
            self._free_add(b)
        else:  # b keeps the part below; mid, and a new block for any part above, come after it
            mid = Block(off, size, owner)
            right = Block(end, bend - end) if end < bend else None
            if ghosts:
                if right is None:
                    b.ghosts, mid.ghosts, _ = cut_at(ghosts, off)
                else:  # two cuts (a compaction's window starts inside a free block)
                    b.ghosts = clip(ghosts, b.off, off)
                    mid.ghosts = clip(ghosts, off, end)
                    right.ghosts = clip(ghosts, end, bend)
                    right.newest = max([g[2] for g in right.ghosts], default=NEVER)
                b.newest = max([g[2] for g in b.ghosts], default=NEVER)
            covered = mid.ghosts
            b.size = off - b.off
            self._link_after(b, mid)
            self._free_add(b)
            if right is not None:
                self._link_after(mid, right)
                self._free_add(right)
        self.used += size
        if self.used > self.peak:
            self.peak = self.used
        if end > self.high:
            self.high = end
        return mid, covered

    def _link_after(self, a: Block | None, b: Block) -> None:
        b.prev = a
        b.next = a.next if a is not None else self.head
        if b.next is not None:
            b.next.prev = b
        else:
            self.tail = b
        if a is not None:
            a.next = b
        else:
            self.head = b

    def _absorb(self, a: Block, b: Block) -> None:
        """Free block a takes over free block b, its neighbour above (unlinked; ghosts merged)."""
        a.next = b.next
        if b.next is not None:
            b.next.prev = a
        else:
            self.tail = a
        a.size += b.size
        g = a.ghosts + b.ghosts
        a.ghosts = bounded(g) if len(g) > MAX_GHOSTS else g
        if b.newest > a.newest:
            a.newest = b.newest

    def release(self, b: Block, readers: tuple[int, ...] | None, time: int) -> None:
        """Frees block `b`. readers None: a retraction, restoring the ghosts it covered."""
        assert b.owner is not None, b
        self.used -= b.size
        self.releases += 1
        b.owner = None
        if readers is not None:
            b.ghosts = [(b.off, b.off + b.size, time, readers)]
            b.newest = time
        else:
            b.newest = max([g[2] for g in b.ghosts], default=NEVER)
        # coalesce with free neighbours
        nxt = b.next
        if nxt is not None and nxt.owner is None:
            self._free_remove(nxt)
            self._absorb(b, nxt)
        prev = b.prev
        if prev is not None and prev.owner is None:
            self._free_remove(prev)
            self._absorb(prev, b)
            b = prev
        self._free_add(b)

    # ---- eviction -----------------------------------------------------------------------------
    def best_window(
        self, size: int, pinned: Mapping[int, Victim], at: int | None = None
    ) -> tuple[int, list[Block]] | None:
        """The window of `size` bytes whose owners' smallest key is largest (see the module header).

        An owner's key is its `dist`: RESERVED + position for an output not computed yet, the
        position of its next use for a live value, inf for a kept value nobody reads again;
        owners whose id() is in `pinned` may not move. Ties go to fewer bytes moved (undoing a
        reservation moves none), then the lower offset. `at` forces the window's offset. Returns
        (offset, owner blocks to evict or undo) or None when every window holds a pinned owner.
        Windows start at block starts; numpy does every window at once (a sparse-table range minimum).
        """
        capacity = self.capacity
        assert capacity is not None  # a GPU arena: host stores grow instead
        blocks = list(self.blocks())
        if at is not None:
            victims = []
            for b in blocks:
                if b.off + b.size > at and b.off < at + size and b.owner is not None:
                    if id(b.owner) in pinned:
                        return None
                    victims.append(b)
            return (at, victims) if at + size <= capacity else None
        offs = np.array([b.off for b in blocks], dtype=np.int64)
        owner_at = cast("list[Victim | None]", [b.owner for b in blocks])  # every owner here is one
        free = np.array([o is None for o in owner_at], dtype=bool)
        keys = np.array([_INF if o is None else o.dist for o in owner_at], dtype=np.float64)
        moves = np.array([b.size for b in blocks], dtype=np.int64)
        moves *= ~free & (keys < RESERVED)  # a produced value moves; a reservation is undone
        keys[~free & (keys == _INF)] = DONE
        where = {id(o): i for i, o in enumerate(owner_at) if o is not None}
        for o in pinned.values():
            i = where.get(id(o))
            if i is not None:
                keys[i] = -1.0
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
        # the largest smallest key, then the fewest bytes moved, then the lowest offset
        far = np.flatnonzero(kmin == kmin.max())
        best = far[np.argmin(moved[far])]
        i, j = int(starts[best]), int(ends[best])
        return int(offs[i]), [b for b in blocks[i:j] if b.owner is not None]

    def clear(self) -> None:
        """Forgets every block, unlinking them (blocks and their owners refer to each other)."""
        b = self.head
        while b is not None:
            nxt = b.next
            b.prev = b.next = b.owner = None
            b.key = ()
            b = nxt
        self.head = self.tail = None
        self.classes.clear()
        self.nonempty.clear()

    def owners(self) -> list[object]:
        return [b.owner for b in self.blocks() if b.owner is not None]
