"""A worker's streams and which one each vertex runs on: the lane rule (pure, no torch).

Streams 0..S-1 run kernels (`actors.slots.StreamSlots` picks one per kernel). The streams
after them are lanes, each for one kind of copy, in this order:

- host-to-device (`h2d`): inputs, reloads from the host store or the caller's copy;
- device-to-host (`d2h`): offloads to the host store;
- one per peer GPU this worker receives transfers from, then one for deferred transfers (NCCL:
  one communicator, its operations in one order, `actors.transports.nccl`), when it has peers;
- two disk lanes (`disk_w`, `disk_r`: offloads to and reloads from the spill file) when the plan
  spills: disk I/O waits on the host, so it never holds back a host copy.

Each copy lane holds at most COPY_DEPTH vertices in flight (one running, the next queued behind
it on the device), the deferred lane any number (NCCL posts its receives in its own order), a
disk lane one (each on a bounce buffer of its own). The executor (`actors.executor`) and the
simulator (`disco_ray.bench.simulate`) both take the lanes from here, so the simulated schedule
follows the runtime's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from disco_ray.graph.memgraph import DISK, HOST, INPUT, MemGraph, MemVertex, MKind

from .backends.base import Mode

COPY_DEPTH = 2  # copies in flight per lane: one running, the next queued behind it on the device


class Route(Enum):
    """What kind of stream a vertex runs on."""

    COMPUTE = "compute"  # a kernel: a compute stream
    LOAD = "h2d"  # an input, or a reload into the arena
    OFFLOAD = "d2h"  # an offload to the host store
    TRANSFER = "peer"  # a pull from another GPU
    SPILL = "disk_w"  # an offload to the spill file
    UNSPILL = "disk_r"  # a reload from the spill file


def route(v: MemVertex) -> Route:
    """The kind of stream vertex `v` runs on (the worker's own reading of it, `actors.plans`)."""
    if v.kind is MKind.KERNEL:
        return Route.COMPUTE
    if v.kind is MKind.TRANSFER:
        return Route.TRANSFER
    if v.kind is MKind.INPUT:
        return Route.LOAD
    disk = len(v.ins) == 1 and DISK in (v.out.device, v.ins[0].loc.device)
    if disk and v.kind is MKind.OFFLOAD:
        return Route.SPILL
    rd = v.ins[0] if v.ins else None
    if disk and rd is not None and rd.src is not None:
        return Route.UNSPILL
    if v.kind is MKind.RELOAD and rd is not None and (rd.src is None or rd.loc.device == INPUT):
        return Route.LOAD  # from the caller's copy of an input
    return Route.OFFLOAD if v.out.device == HOST else Route.LOAD


def spills(vertices: Iterable[MemVertex]) -> bool:
    """Whether these vertices write or read the spill file (the worker then has disk lanes)."""
    return any(v.out.device == DISK or any(r.loc.device == DISK for r in v.ins) for v in vertices)


@dataclass(frozen=True, slots=True)
class Lanes:
    """The stream indices of one worker's lanes and their limits of vertices in flight."""

    streams: int  # compute streams: 0..streams-1
    peers: tuple[int, ...]  # the GPUs this worker receives transfers from, in lane order
    disk: bool  # the worker has disk lanes

    @staticmethod
    def of(mg: MemGraph, gpu: int, streams: int) -> Lanes:
        """The lanes of GPU `gpu` of `mg` with `streams` compute streams."""
        mine = [v for v in mg.vertices if v.gpu == gpu]
        peers = sorted({v.ins[0].loc.device for v in mine if route(v) is Route.TRANSFER})
        return Lanes(streams, tuple(peers), spills(mine))

    @property
    def h2d(self) -> int:
        return self.streams

    @property
    def d2h(self) -> int:
        return self.streams + 1

    @property
    def peer(self) -> dict[int, int]:
        """Source GPU -> the lane of its transfers."""
        return {p: self.streams + 2 + k for k, p in enumerate(self.peers)}

    @property
    def deferred(self) -> int:
        return self.streams + 2 + len(self.peers)

    @property
    def limits(self) -> tuple[int | None, ...]:
        """Per lane (stream index - streams): how many vertices it holds in flight (None: any)."""
        copies: tuple[int | None, ...] = (COPY_DEPTH,) * (2 + len(self.peers))
        return copies + ((None,) if self.peers else ()) + ((1, 1) if self.disk else ())

    @property
    def disk_w(self) -> int:
        return self.streams + 2 + len(self.peers) + (1 if self.peers else 0)

    @property
    def disk_r(self) -> int:
        return self.disk_w + 1

    @property
    def total(self) -> int:
        """Compute streams and lanes."""
        return self.streams + len(self.limits)

    def lane(self, v: MemVertex, mode: Mode = Mode.LAUNCH) -> int | None:
        """The lane of vertex `v` (None: a kernel, which goes to a compute stream); `mode`: how a
        transfer's pull behaves (`actors.backends.base.Mode`), DEFERRED ones sharing the deferred lane."""
        r = route(v)
        if r is Route.COMPUTE:
            return None
        if r is Route.TRANSFER:
            src = v.ins[0].loc.device
            return self.deferred if mode == Mode.DEFERRED else self.streams + 2 + self.peers.index(src)
        return {
            Route.LOAD: self.h2d,
            Route.OFFLOAD: self.d2h,
            Route.SPILL: self.disk_w,
            Route.UNSPILL: self.disk_r,
        }[r]

    def assign(
        self, vertices: Iterable[MemVertex], mode_of: Callable[[int], Mode]
    ) -> tuple[dict[int, int], dict[int, Mode]]:
        """(the lane of each copy and transfer, the mode of each vertex whose work is not LAUNCH);
        `mode_of(src_gpu)`: how a pull from that GPU behaves (the transport's `mode`)."""
        lane_of: dict[int, int] = {}
        mode: dict[int, Mode] = {}
        for v in vertices:
            r = route(v)
            m = Mode.LAUNCH
            if r in (Route.SPILL, Route.UNSPILL):
                m = Mode.BLOCKING  # file I/O waits on the host (cuda: on a helper thread)
            elif r is Route.TRANSFER:
                m = mode_of(v.ins[0].loc.device)
            lane = self.lane(v, m)
            if lane is not None:
                lane_of[v.id] = lane
            if m != Mode.LAUNCH:
                mode[v.id] = m
        return lane_of, mode

    def engine(self, stream: int) -> Route:
        """What stream `stream` carries (the device engine it uses)."""
        if stream < self.streams:
            return Route.COMPUTE
        if stream == self.h2d:
            return Route.LOAD
        if stream == self.d2h:
            return Route.OFFLOAD
        if self.disk and stream == self.disk_w:
            return Route.SPILL
        if self.disk and stream == self.disk_r:
            return Route.UNSPILL
        return Route.TRANSFER
