"""planner.arena: random takes (at the chosen spot and anywhere inside a free block) and releases
(with readers, or retractions) keep the block list, the free index and the overwrite history right."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from planner.arena import NEVER, Arena

ALIGN = 16


def check_structure(a: Arena, cap: int) -> None:
    blocks = list(a.blocks())
    assert a.head is blocks[0] and a.tail is blocks[-1] and blocks[0].prev is None and blocks[0].off == 0
    assert blocks[-1].off + blocks[-1].size == cap
    for x, y in pairwise(blocks):
        assert x.off + x.size == y.off and x.next is y and y.prev is x
        assert x.owner is not None or y.owner is not None, "free neighbours left apart"
    free = [b for b in blocks if b.owner is None]
    indexed = [k for c in a.nonempty for k in a.classes[c]]
    assert a.nonempty == sorted(a.classes) and all(a.classes[c] for c in a.nonempty)
    assert sorted(id(k[-1]) for k in indexed) == sorted(id(b) for b in free), "free index out of step"
    for b in free:
        assert b.key in a.classes[b.cls] and b.cls == b.size.bit_length()
        assert all(b.off <= g[0] < g[1] <= b.off + b.size for g in b.ghosts), (b, b.ghosts)
        assert b.newest == max((g[2] for g in b.ghosts), default=NEVER)
    assert a.used == sum(b.size for b in blocks if b.owner is not None)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("fit", ["oldest", "best", "fewest"])
def test_random_takes_and_releases_keep_the_arena_right(seed, fit):
    rng = random.Random(seed)
    units = rng.randint(4, 40)
    cap = units * ALIGN
    a = Arena(cap, ALIGN, fit)
    last: list[tuple[int, ...]] = [()] * units  # per unit: the readers of its last release
    held: dict[int, tuple[object, list]] = {}  # owner id -> (block, the units' history it replaced)
    for t in range(400):
        if held and (rng.random() < 0.45 or not a.nonempty):
            key = rng.choice(sorted(held))
            blk, before = held.pop(key)
            lo, hi = blk.off // ALIGN, (blk.off + blk.size) // ALIGN
            if rng.random() < 0.2:  # a retraction: the history it covered comes back
                a.release(blk, None, t)
                last[lo:hi] = before
            else:
                readers = tuple(rng.sample(range(1000), rng.randint(1, 3)))
                a.release(blk, readers, t)
                last[lo:hi] = [readers] * (hi - lo)
        else:
            size = rng.randint(1, max(1, units // 3)) * ALIGN
            spot = a.best_free(size)
            if spot is None:
                continue
            b, off = spot
            if rng.random() < 0.5:  # anywhere inside a free block that holds it (a compaction's window)
                room = [x for x in a.blocks() if x.owner is None and x.size >= size]
                b = rng.choice(room)
                off = b.off + rng.randint(0, (b.size - size) // ALIGN) * ALIGN
            owner = object()
            blk, covered = a.take(b, off, size, owner)
            assert blk.owner is owner and blk.off == off and blk.size == size
            lo, hi = off // ALIGN, (off + size) // ALIGN
            seen = {r for g in covered for r in g[3]}
            assert all(g[0] < off + size and g[1] > off for g in covered), "a covered ghost lies outside"
            for u in range(lo, hi):  # whoever read these bytes last must come before the new writer
                assert set(last[u]) <= seen, (t, u, last[u], covered)
            held[id(owner)] = (blk, last[lo:hi])
        check_structure(a, cap)
