"""A stand-in for cupy.cuda.nccl, in one process, with NCCL's blocking semantics: the ranks are
threads of a test (each worker's NCCL channel), the buffers CPU tensors of the stand-in device
(tests/fake_cuda.py), and the streams its `FakeStream`s.

What it models, as NCCL's user guide describes it:
- `NcclCommunicator(n, uid, rank)` blocks until all `n` ranks of `uid` have joined;
- the first operation between two ranks connects them: the host call (`send`, `recv`, or
  `groupEnd` for a group) blocks until the peer has posted an operation towards this rank;
- a send and a receive match by their order between that pair of ranks (the k-th send from a to
  b with the k-th receive at b from a); sizes must agree;
- on the device an operation completes only once it matched and both ends reached it: it is a
  blocking item in its stream's order (`fake_cuda`), after everything enqueued before it, and,
  since a communicator runs its operations in the order they were posted, after the
  communicator's previous group; the operations of one group run concurrently;
- thread safety: every call on a communicator, except `abort`, must come from the thread that
  created it (the stand-in raises AssertionError naming both threads), and a group's calls from
  the thread that opened the group;
- `abort` ends the communicator's pending operations (no data moves); a rank that `kill` marks
  dead never completes anything (its peers' operations wait for ever, as on a GPU), and, when
  `World.remote_errors` is set, its peers' `check_async_error` raises, as NCCL does when it
  notices a lost peer.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import threading

from tests.fake_cuda import FakeStream, _Item, _lock

NCCL_UINT8 = 1
NCCL_UNIQUE_ID_BYTES = 128
TIMEOUT_S = 60.0  # the stand-in's own bound on a host wait, so a broken test fails, never hangs


class NcclError(RuntimeError):
    pass


class World:
    """The ranks of one unique id."""

    def __init__(self, nranks: int):
        self.nranks = nranks
        self.comms: dict[int, NcclCommunicator] = {}
        self.cond = threading.Condition(_lock)
        self.wants: set[tuple[int, int]] = set()  # (a, b): a has posted towards b
        self.queues: dict[tuple[int, int, bool], collections.deque] = collections.defaultdict(
            collections.deque
        )
        self.dead: set[int] = set()
        self.remote_errors = False
        self.connects: list[tuple[int, int]] = []  # pairs in the order they connected

    def kill(self, rank: int) -> None:
        with self.cond:
            self.dead.add(rank)
            self.cond.notify_all()


WORLDS: dict[tuple, World] = {}
_ids = itertools.count(1)
_group = threading.local()


def get_unique_id() -> tuple:
    return (next(_ids),) + (0,) * (NCCL_UNIQUE_ID_BYTES - 1)


def world_of(uid: tuple) -> World:
    return WORLDS[tuple(uid)]


class _Op(_Item):
    """One send or receive in its stream's order."""

    __slots__ = ("comm", "copied", "count", "partner", "peer", "ptr", "send")

    def __init__(self, prev, comm, send, ptr, count, peer):
        super().__init__(prev)
        self.comm, self.send, self.ptr, self.count, self.peer = comm, send, ptr, count, peer
        self.partner: _Op | None = None
        self.copied = False

    def started(self) -> bool:
        return self.prev is None or self.prev.complete()

    def ready(self) -> bool:
        comm, world = self.comm, self.comm.world
        if comm.aborted:
            return True  # abort ends the operation; nothing moves
        p = self.partner
        if comm.rank in world.dead or p is None or p.comm.rank in world.dead or p.comm.aborted:
            return False
        if not p.started():
            return False
        if p.count != self.count:
            comm.async_error = f"send and receive of {self.count} and {p.count} bytes matched"
            return True
        if not self.copied:  # the receive's bytes arrive when both ends run
            src, dst = (self, p) if self.send else (p, self)
            ctypes.memmove(dst.ptr, src.ptr, self.count)
            self.copied = p.copied = True
        return True


class _All(_Item):
    """The end of a group: done once all its operations are."""

    __slots__ = ("ops",)

    def __init__(self, ops):
        super().__init__(None)
        self.ops = ops

    def ready(self) -> bool:
        return all(op.complete() for op in self.ops)


class _Both(_Item):
    __slots__ = ("other",)

    def __init__(self, prev, other):
        super().__init__(prev)
        self.other = other

    def ready(self) -> bool:
        return self.other is None or self.other.complete()


class NcclCommunicator:
    def __init__(self, ndev: int, commId: tuple, rank: int):
        self.world = WORLDS.setdefault(tuple(commId), World(ndev))
        self.rank = rank
        self.owner = threading.current_thread()
        self.aborted = False
        self.destroyed = False
        self.async_error: str | None = None
        self.tail: _Item | None = None  # the last group: a communicator runs in posting order
        world = self.world
        with world.cond:
            assert rank not in world.comms, f"rank {rank} joined twice"
            world.comms[rank] = self
            world.cond.notify_all()
            if not world.cond.wait_for(lambda: len(world.comms) == world.nranks, TIMEOUT_S):
                raise NcclError(f"rank {rank}: not every rank joined the communicator")

    def _mine(self) -> None:
        me = threading.current_thread()
        assert me is self.owner, (
            f"NCCL communicator of rank {self.rank} used from thread {me.name}; it belongs to {self.owner.name}"
        )
        if self.aborted or self.destroyed:
            raise NcclError(f"rank {self.rank}: the communicator was aborted or destroyed")

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._mine()
        _submit((self, True, sendbuf, count, peer, stream))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._mine()
        _submit((self, False, recvbuf, count, peer, stream))

    def check_async_error(self) -> None:
        self._mine()
        if self.async_error:
            raise NcclError(self.async_error)
        world = self.world
        if world.remote_errors and any(r in world.dead for r in world.comms if r != self.rank):
            raise NcclError("remote process exited or there was a network error")

    def abort(self) -> None:  # the one call NCCL allows from any thread
        with self.world.cond:
            self.aborted = True
            self.world.cond.notify_all()

    def destroy(self) -> None:
        self._mine()
        self.destroyed = True

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.world.nranks


def groupStart() -> None:
    depth = getattr(_group, "depth", 0)
    if depth == 0:
        _group.ops = []
    _group.depth = depth + 1


def groupEnd() -> None:
    _group.depth -= 1
    if _group.depth == 0:
        ops, _group.ops = _group.ops, []
        _post(ops)


def _submit(op: tuple) -> None:
    if getattr(_group, "depth", 0):
        _group.ops.append(op)
    else:
        _post([op])


def _post(ops: list[tuple]) -> None:
    """Posts one group: connects its pairs (blocking), then enqueues and matches its operations."""
    if not ops:
        return
    comm = ops[0][0]
    world = comm.world
    assert all(o[0] is comm for o in ops), "a group mixing communicators"
    me = comm.rank
    peers = sorted({o[4] for o in ops})
    with world.cond:
        for p in peers:
            world.wants.add((me, p))
        world.cond.notify_all()
        for p in peers:
            ok = world.cond.wait_for(lambda p=p: (p, me) in world.wants or comm.aborted, TIMEOUT_S)
            if not ok:
                raise NcclError(f"rank {me}: rank {p} never connected")
            if (min(me, p), max(me, p)) not in world.connects:
                world.connects.append((min(me, p), max(me, p)))
        streams = {o[5] for o in ops}
        assert len(streams) == 1, "one group, one stream (as this design posts them)"
        stream = FakeStream.by_handle[streams.pop()]
        start = _Both(stream.tail, comm.tail)  # after the stream's work and the communicator's last group
        items = []
        for c, send, ptr, count, peer, _ in ops:
            op = _Op(start, c, send, ptr, count, peer)
            key = (me, peer, True) if send else (peer, me, False)
            other = (me, peer, False) if send else (peer, me, True)
            waiting = world.queues[other]
            if waiting:
                partner = waiting.popleft()
                op.partner, partner.partner = partner, op
            else:
                world.queues[key].append(op)
            items.append(op)
        end = _All(items)
        stream.tail = comm.tail = end


def connect_all(eng, infos: list, paths: dict, uid, wait_s: float) -> None:
    """Connects the transports of local engine `eng`'s workers at once, each in its own thread
    (a communicator's members block until all have joined, as the driver's connect calls do);
    the first error closes the engine and is raised."""
    errors: list = []

    def connect(g):
        try:
            eng.execs[g].transport.connect(infos, paths, uid)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=connect, args=(g,), daemon=True) for g in range(len(eng.execs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait_s)
    if errors:
        eng.close()
        raise errors[0]
