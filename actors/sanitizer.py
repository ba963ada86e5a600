"""Run-time sanitizer (`check=True`): every read must see the writer the MemGraph names.

Each arena and host-store granule remembers the MemGraph vertex that last wrote it (-1: never;
`-2 - v`: vertex v is writing it right now). A reader checks its ranges before and after it
runs, so both a wrong plan (another value lies there) and a race (a writer overlapping the read
in time, which random delays make likely) stop the run with a RunError naming the reader, the
expected and the found writer. Granules are the gcd of every offset and size of the worker's
ranges (at most 256 bytes), so two tensors never share one.

The sum-into kernels of one `accumulate` write its range one at a time in any order: they record
the group's last member (the writer its readers name, `alias`), and a member that starts while
another member of its group is writing fails the run (the write lock was not held).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import DISK, HOST, Loc

NEVER = -1


def granule_for(locs: Iterable[Loc], cap: int = 256) -> int:
    g = cap
    for loc in locs:
        g = math.gcd(g, loc.offset, loc.nbytes)
        if g == 1:
            break
    return max(g, 1)


class Sanitizer:
    """Shadow writers of one worker's arena (device `gpu`) and host store."""

    def __init__(
        self,
        gpu: int,
        arena_bytes: int,
        host_bytes: int,
        granule: int,
        describe: Callable[[int], str],
        alias: dict[int, int] | None = None,
        disk_bytes: int = 0,
    ):
        self.gpu = gpu
        self.alias = alias or {}  # sum-into member -> the member its group's readers name
        self.granule = granule
        self.describe = describe
        self._shadow = {
            gpu: np.full(-(-arena_bytes // granule), NEVER, np.int32),
            HOST: np.full(-(-host_bytes // granule), NEVER, np.int32),
            DISK: np.full(-(-disk_bytes // granule), NEVER, np.int32),  # the spill file
        }
        self.checks = 0

    def reset(self) -> None:
        for a in self._shadow.values():
            a.fill(NEVER)

    def _slice(self, loc: Loc) -> np.ndarray:
        g = self.granule
        return self._shadow[loc.device][loc.offset // g : -(-loc.end // g)]

    def begin_write(self, loc: Loc, vid: int) -> None:
        who = self.alias.get(vid, vid)
        s = self._slice(loc)
        if vid in self.alias and s.size and (s == -2 - who).any():
            raise RunError(
                f"sanitizer: {self.describe(vid)} on gpu:{self.gpu} started while another sum-into "
                "kernel of its group was writing (no write lock)"
            )
        s[:] = -2 - who

    def end_write(self, loc: Loc, vid: int) -> None:
        self._slice(loc)[:] = self.alias.get(vid, vid)

    def before(self, vid: int, checks: Iterable[tuple[str, Loc, int]], out: Loc) -> None:
        """Vertex `vid` starts: what it reads (`checks`: value, range, writer) still holds it,
        and its write of `out` begins."""
        for value, loc, src in checks:
            self.check_read(vid, value, loc, src, "before it ran")
        self.begin_write(out, vid)

    def after(self, vid: int, checks: Iterable[tuple[str, Loc, int]], out: Loc) -> None:
        """Vertex `vid` ended: what it read was not overwritten meanwhile, and its write ends."""
        for value, loc, src in checks:
            self.check_read(vid, value, loc, src, "after it ran")
        self.end_write(out, vid)

    def check_read(self, reader: int, value: str, loc: Loc, expect: int, when: str) -> None:
        """Raises RunError unless every granule of `loc` was last written, completely, by `expect`."""
        self.checks += 1
        s = self._slice(loc)
        if s.size == 0:
            return
        bad = np.flatnonzero(s != expect)
        if bad.size == 0:
            return
        found = int(s[bad[0]])
        at = loc.offset + int(bad[0]) * self.granule
        where = "host" if loc.device == HOST else "disk" if loc.device == DISK else f"gpu:{loc.device}"
        if found == NEVER:
            what = "nothing (never written)"
        elif found <= -2:
            what = f"{self.describe(-2 - found)} while it was still writing"
        else:
            what = self.describe(found)
        raise RunError(
            f"sanitizer: {self.describe(reader)} on gpu:{self.gpu} reads {value!r} at {where} "
            f"byte {at} ({when}) and expected the write of {self.describe(expect)}, "
            f"found {what}"
        )
