"""The reachability questions that decide whether an arena's reads are race-free (for the verifier).

FORMATS.md: no writer of a range overlapping a read may run between the read's source and its
reader. Cut the arena into elementary segments between all range boundaries; on one segment list
its writers w_1..w_k by topological rank. A read of w_i by r needs every other writer ordered
around it: w_j (j < i) an ancestor of w_i, and r an ancestor of w_j (j > i); a final output is a
read nobody follows, so no writer may come after it. Transitivity cuts these k^2 pairs to about k:
with i' the previous and i'' the next writer on the segment that is read, it is enough that
w_j -> w_i for j in [i', i) (earlier ones reach w_i through w_i', which is itself checked, by
induction), and that r -> w_j for j in (i, i''] (later ones are reached through w_i'' and its own
readers, since w_i'' -> each reader of it is the read check). Both sets are built for all segments
at once with numpy, deduplicated, and handed to planner.reach in one batch. If every pair holds,
no race exists; if one fails, that pair names a race (or a read that is already wrong).

Rejected: testing every (read, overlapping writer) pair against an n x n bit matrix
(quadratic memory), and per-pair graph searches.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

_I = np.int64


def _spans(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner k, value) for every value in [lo[k], hi[k]): the ranges concatenated."""
    counts = np.maximum(hi - lo, 0)
    owner = np.repeat(np.arange(len(lo), dtype=_I), counts)
    start = np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return owner, start + np.arange(int(counts.sum()), dtype=_I)


class ArenaRaces:
    """One arena's race conditions as ancestor questions (see the header); answer them in a batch.

    Args:
        writers: (offset, end, vertex) of every vertex writing this arena.
        reads: (offset, end, src vertex, reader vertex or -1 for a final output, read index).
        rank: each vertex's rank in a topological order.
    """

    def __init__(
        self, writers: list[tuple[int, int, int]], reads: list[tuple[int, int, int, int, int]], rank
    ):
        self.u = self.w = np.zeros(0, dtype=_I)
        self.out_q = self.out_w = np.zeros(0, dtype=_I)
        self.na = 0
        if not writers or not reads:
            return
        wa = np.array(writers, dtype=_I)
        qa = self.qa = np.array(reads, dtype=_I)
        cuts = np.unique(np.concatenate((wa[:, 0], wa[:, 1], qa[:, 0], qa[:, 1])))
        # writers' segment incidences, sorted by (segment, rank of the writer)
        wk, seg = _spans(np.searchsorted(cuts, wa[:, 0]), np.searchsorted(cuts, wa[:, 1]))
        vert = wa[wk, 2]
        o = np.lexsort((rank[vert], seg))
        seg, vert = seg[o], vert[o]
        m = len(seg)
        if not m:
            return
        first = np.searchsorted(seg, seg, side="left")  # each incidence's segment: [first, last]
        last = np.searchsorted(seg, seg, side="right") - 1
        # reads' segment incidences, matched to the incidence of their source on the segment
        qk, qseg = _spans(np.searchsorted(cuts, qa[:, 0]), np.searchsorted(cuts, qa[:, 1]))
        n = int(max(int(vert.max()), int(qa[:, 2].max()))) + 1
        key = seg * n + vert
        ko = np.argsort(key, kind="stable")
        sk = key[ko]
        want = qseg * n + qa[qk, 2]
        at = np.minimum(np.searchsorted(sk, want), m - 1)
        hit = sk[at] == want  # a source that does not write the segment is a wrong read: reported there
        qk, g = qk[hit], ko[at[hit]]
        has = np.zeros(m, dtype=bool)
        has[g] = True
        idx = np.arange(m, dtype=_I)
        # previous / next incidence on the same segment whose writer is read there
        prev = np.maximum.accumulate(np.where(has, idx, -1))
        prev = np.concatenate(([-1], prev[:-1]))
        prev = np.where(prev >= first, prev, first)  # none before: from the segment's first writer
        nxt = np.minimum.accumulate(np.where(has, idx, m)[::-1])[::-1]
        nxt = np.concatenate((nxt[1:], [m]))
        nxt = np.where(nxt <= last, nxt, last)  # none after: to the segment's last writer
        # (A) w_j -> w_i for read-having i, j in [prev, i); its origin: one read of w_i there
        read_of = np.full(m, -1, dtype=_I)
        read_of[g] = qk
        ai = np.flatnonzero(has)
        a_owner, a_j = _spans(prev[ai], ai)
        a_i = ai[a_owner]
        # (B) reader -> w_j for each read of w_i, j in (i, nxt]
        b_owner, b_j = _spans(g + 1, nxt[g] + 1)
        b_q = qk[b_owner]
        reader = qa[b_q, 3]
        out = reader < 0  # a final output: any later writer overwrites it, no question to ask
        self.u = np.concatenate((vert[a_j], reader[~out]))
        self.w = np.concatenate((vert[a_i], vert[b_j[~out]]))
        self.q = np.concatenate((read_of[a_i], b_q[~out]))  # the read each question is about
        self.writer = np.concatenate((vert[a_j], vert[b_j[~out]]))  # the writer that may race
        self.out_q, self.out_w = b_q[out], vert[b_j[out]]

    def violations(self, ok: np.ndarray) -> Iterator[tuple[int, int, int, int]]:
        """(src, writer, reader or -1, read index) of each race, given the answers to (u, w)."""
        seen: set[tuple[int, int, int, int]] = set()
        qa = getattr(self, "qa", None)
        if qa is None:
            return
        for q, wr in zip(
            np.concatenate((self.q[~ok], self.out_q)).tolist(),
            np.concatenate((self.writer[~ok], self.out_w)).tolist(),
        ):
            item = (int(qa[q, 2]), wr, int(qa[q, 3]), int(qa[q, 4]))
            if item not in seen:
                seen.add(item)
                yield item
