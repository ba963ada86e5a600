"""NCCL transfers: one communicator per graph's worker group, one thread per communicator, one
order for every operation on it, and bounded waits.

What NCCL demands (its user guide: point-to-point communication, group calls, thread safety,
using multiple communicators; checked against the stand-in of tests/fake_nccl.py):
- a send and its receive match by their order between that pair of ranks, so both ends must
  post the pair's transfers in the same order;
- the first send or receive between two ranks connects them and blocks the host until the peer
  posts its side;
- an operation runs on the device until it has matched: a rank's operations execute in the order
  posted, so two ranks that post their pair's transfers in different orders, or a send in each
  direction before the receives, deadlock (past NCCL's buffer size);
- a communicator must not be used by two threads at once (nor a group split between threads),
  and operations on two communicators of one device must not interleave.

The design:
- **One agreed order.** Every transfer between two GPUs of the communicator is a pair of
  operations (the source's send, the destination's receive), and each worker posts ITS
  operations in increasing transfer id (`nccl_ops`). Ids are a topological order of the MemGraph
  (every edge goes from a lower to a higher id), so this is deadlock-free: the lowest transfer
  not done has every predecessor done, and every operation of either end posted before it
  belongs to a lower transfer, hence is done; so both ends post it, and it completes.
- **One thread per communicator** (`NcclChannel`, one per worker and graph) makes every NCCL
  call: creating the communicator, a warm-up that connects every pair at load time (so no
  transfer of a run blocks on a connection), the groups, the checks, abort and destroy. Its
  operations all go on one stream, the worker's deferred lane.
- **Readiness.** A send is ready once the vertex that wrote its source range has completed on
  this worker (`source_done`; the plan keeps the range intact until the receiver is done). A
  receive is ready once the destination's loop has launched the transfer vertex
  (`post_recv`: its destination range is free); its device work is enqueued here, at its turn,
  through the backend's `external_begin/end` (the stream waits on the vertex's predecessors,
  records its events), and the loop finds its completion as for any vertex.
- **Groups** (`next_group`): consecutive ready operations are posted as one NCCL group, so both
  directions of a pair, or sends to several peers, move at once. A group ends at its first
  receive: a receive's vertex completes with its whole group, and an operation after it might
  (through other GPUs) wait for that very completion; operations before it belong to lower
  transfers, which cannot.
- **Bounded waits.** A posted group that makes no progress for `timeout_s` (DISCO_NCCL_TIMEOUT_S,
  default 300 s: a receive may legitimately wait for a slow sender), or an asynchronous NCCL
  error (a peer process lost: `check_async_error`), aborts the communicator, which ends its
  operations, and fails the run with an error naming the peer. Under Ray a dead worker is
  usually noticed first by the driver (seconds); this is the bound when it is not. The warm-up
  at load time is bounded the same way.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc, MemGraph, MKind

from ..backends.base import Backend

TIMEOUT_S = 300.0  # default of DISCO_NCCL_TIMEOUT_S (read by actors.transports.cuda at connect)
CONNECT_TIMEOUT_S = 120.0
GROUP_LIMIT = 64  # operations per group: NCCL fuses a group into one launch
TICK_S = 0.05  # how often the thread looks at its posted groups while some are in flight


@dataclass(frozen=True, slots=True)
class NcclOp:
    """One side of one transfer: `send` from this worker, or a receive into it."""

    vid: int  # the transfer vertex (it runs on the receiving GPU)
    send: bool
    peer: int  # the GPU on the other end
    src_vid: int  # the vertex that wrote the source range (-1: none)
    loc: Loc  # the source range, in the sender's arena
    nbytes: int


def nccl_ops(mg: MemGraph, gpu: int, peers: Sequence[int]) -> list[NcclOp]:
    """Every transfer between `gpu` and one of `peers`, both directions, in id order: the order
    both ends of every pair post them in (pure)."""
    peer_set = set(peers)
    out = []
    for v in mg.vertices:
        if v.kind is not MKind.TRANSFER:
            continue
        r = v.ins[0]
        src = r.loc.device
        src_vid = -1 if r.src is None else r.src
        if v.gpu == gpu and src in peer_set:
            out.append(NcclOp(v.id, False, src, src_vid, r.loc, v.out.nbytes))
        elif src == gpu and v.gpu in peer_set:
            out.append(NcclOp(v.id, True, v.gpu, src_vid, r.loc, r.loc.nbytes))
    return sorted(out, key=lambda op: op.vid)


def next_group(ops: Sequence[NcclOp], cursor: int, ready: set[int], limit: int = GROUP_LIMIT) -> int:
    """How many operations from `cursor` form the next group: the consecutive ready ones, up to
    and including the first receive (pure; 0: the next one is not ready)."""
    n = 0
    while cursor + n < len(ops) and n < limit and cursor + n in ready:
        n += 1
        if not ops[cursor + n - 1].send:
            break
    return n


class NcclChannel:
    """The NCCL side of one worker for one graph: its communicator and the thread that uses it.

    Args:
        gpu: this worker's GPU; `ranks`: GPU -> rank in the communicator (its members).
        uid: the communicator's unique id (made once, by one member).
        peers: the GPUs this worker transfers with over NCCL (connected by the warm-up).
        ops: `nccl_ops` of this worker.
        nccl: the NCCL module (cupy.cuda.nccl, or the stand-in of the tests).
        device: this worker's CUDA device.
        fail: ends the run with a message (the executor's `fail`).
    """

    def __init__(
        self,
        gpu: int,
        ranks: dict[int, int],
        uid: Any,
        peers: Sequence[int],
        ops: Sequence[NcclOp],
        nccl: Any,
        device: torch.device,
        fail: Callable[[str], None],
        timeout_s: float = TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ):
        self.gpu, self.ranks, self.uid, self.peers = gpu, dict(ranks), uid, sorted(peers)
        self.ops = list(ops)
        self.nccl, self.device, self._fail, self.timeout_s = nccl, device, fail, timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.by_src: dict[int, list[int]] = collections.defaultdict(list)
        self.recv_index: dict[int, int] = {}
        for i, op in enumerate(self.ops):
            if op.send:
                self.by_src[op.src_vid].append(i)
            else:
                self.recv_index[op.vid] = i
        self.cond = threading.Condition()
        self.ready: set[int] = set()
        self.dst: dict[int, torch.Tensor] = {}  # receive vid -> its destination view, this run
        self.cursor = len(self.ops)  # no run yet
        self.error: str | None = None
        self.stop = False
        self.comm: Any = None
        self.stream: Any = None  # the worker's deferred lane: every operation goes on it
        self.backend: Any = None  # the worker's `Backend`: `external_begin/end` of the receives
        self.source: Callable[[NcclOp], torch.Tensor] | None = None  # the bytes a send reads
        self.groups = 0
        self.posted_ops = 0
        self._posted: collections.deque = collections.deque()  # (marker, posted at, group)
        self._markers: list = []  # completed markers, reused
        self._progress = time.monotonic()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- setup ---------------------------------------------------------------------------------
    def start(self, backend: Backend, stream: Any, source: Callable[[NcclOp], torch.Tensor]) -> None:
        """Starts the thread: it creates the communicator (every member at once: the driver calls
        each worker's connect together) and connects each peer; returns once both are done.

        Raises:
            RunError: naming the peers, when that did not finish within `connect_timeout_s` or failed.
        """
        self.backend, self.stream, self.source = backend, stream, source
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"nccl-{self.gpu}")
        self._thread.start()
        peers = ", ".join(f"gpu:{p}" for p in self.peers)
        if not self._started.wait(self.connect_timeout_s):
            self.error = (
                f"gpu:{self.gpu}: connecting to {peers} over NCCL did not finish within "
                f"{self.connect_timeout_s:g} s: one of them is lost or did not join"
            )
            with contextlib.suppress(Exception):  # the one call NCCL allows from another thread
                if self.comm is not None:
                    self.comm.abort()
        if self.error is not None:
            raise RunError(self.error)

    def _main(self) -> None:
        try:
            torch.cuda.set_device(self.device)
            self.comm = self.nccl.NcclCommunicator(len(self.ranks), self.uid, self.ranks[self.gpu])
            self._warm_up()
        except BaseException as e:
            self.error = self.error or f"gpu:{self.gpu}: setting up NCCL with {self.peers} failed: {e}"
            self._started.set()
            return
        self._started.set()
        try:
            self._serve()
        except BaseException as e:  # a bug: end the run rather than leave transfers hanging
            self._broken(f"gpu:{self.gpu}: the NCCL thread failed: {type(e).__name__}: {e}")
        finally:
            self._teardown()

    def _warm_up(self) -> None:
        """One byte to and from every peer in one group: connects each pair now, at load time."""
        if not self.peers:
            return
        buf = torch.zeros(2 * len(self.peers), dtype=torch.uint8, device=self.device)
        nccl, st = self.nccl, self.stream.cuda_stream
        nccl.groupStart()
        for k, p in enumerate(self.peers):
            self.comm.send(buf[2 * k].data_ptr(), 1, nccl.NCCL_UINT8, self.ranks[p], st)
            self.comm.recv(buf[2 * k + 1].data_ptr(), 1, nccl.NCCL_UINT8, self.ranks[p], st)
        nccl.groupEnd()
        done = torch.cuda.Event()
        done.record(self.stream)
        t_end = time.monotonic() + self.connect_timeout_s
        while not done.query():
            if time.monotonic() > t_end:
                raise RunError(f"the warm-up exchange did not complete within {self.connect_timeout_s:g} s")
            self.comm.check_async_error()
            time.sleep(1e-3)

    # ---- a run ---------------------------------------------------------------------------------
    def begin_run(self) -> None:
        """A new run: nothing is ready; sends of ranges no vertex wrote are."""
        with self.cond:
            if self.error is not None:
                raise RunError(self.error)
            if self.cursor != len(self.ops):
                raise RunError(f"gpu:{self.gpu}: the previous run's NCCL transfers did not all complete")
            self.cursor = 0
            self.ready = set(self.by_src.get(-1, ()))
            self.dst = {}
            self.cond.notify()

    def source_done(self, vid: int) -> None:
        """Vertex `vid` of this worker completed: the sends of its range may go."""
        with self.cond:
            self.ready.update(self.by_src.get(vid, ()))
            self.cond.notify()

    def post_recv(self, vid: int, dst: torch.Tensor) -> None:
        """The destination launched transfer `vid` (its range `dst` is free): it may be received."""
        with self.cond:
            if self.error is not None:
                raise RunError(self.error)
            self.dst[vid] = dst
            self.ready.add(self.recv_index[vid])
            self.cond.notify()

    def watched(self) -> set[int]:
        """The vertices whose completion releases a send."""
        return {v for v in self.by_src if v >= 0}

    def _serve(self) -> None:
        while True:
            with self.cond:
                while not self.stop and (n := next_group(self.ops, self.cursor, self.ready)) == 0:
                    self.cond.wait(TICK_S if self._posted else None)
                    if self._posted:
                        self._watch()
                if self.stop:
                    return
                group = self.ops[self.cursor : self.cursor + n]
                self.cursor += n
                dsts = [self.dst.get(op.vid) for op in group]
            self._post(group, dsts)
            self._watch()

    def _post(self, group: list[NcclOp], dsts: list[torch.Tensor | None]) -> None:
        nccl, comm = self.nccl, self.comm
        last = group[-1]
        recv = None if last.send else last
        exc: BaseException | None = None
        stream = self.stream
        try:
            if recv is not None:
                stream = self.backend.external_begin(recv.vid)  # waits on its predecessors, start event
            nccl.groupStart()
            try:
                for op, dst in zip(group, dsts, strict=True):
                    if op.send:
                        assert self.source is not None
                        buf = self.source(op)
                        comm.send(
                            buf.data_ptr(),
                            op.nbytes,
                            nccl.NCCL_UINT8,
                            self.ranks[op.peer],
                            stream.cuda_stream,
                        )
                    else:
                        assert dst is not None, f"receive {op.vid} posted without its destination"
                        comm.recv(
                            dst.data_ptr(),
                            op.nbytes,
                            nccl.NCCL_UINT8,
                            self.ranks[op.peer],
                            stream.cuda_stream,
                        )
            finally:
                nccl.groupEnd()
        except BaseException as e:
            exc = e
        if recv is not None:
            self.backend.external_end(recv.vid, exc)
        self.groups += 1
        self.posted_ops += len(group)
        marker = self._markers.pop() if self._markers else torch.cuda.Event()  # ordering only: no timing
        marker.record(stream)
        self._posted.append((marker, time.monotonic(), group))
        if exc is not None:
            self._broken(f"gpu:{self.gpu}: posting {_what(group[0])} over NCCL failed: {exc}")

    def _watch(self) -> None:
        """Retires completed groups; fails the run when the oldest made no progress for
        `timeout_s` or NCCL reports an asynchronous error."""
        now = time.monotonic()
        posted = self._posted
        while posted and posted[0][0].query():
            self._markers.append(posted.popleft()[0])
            self._progress = now
        if not posted or self.error is not None:
            return
        _, at, group = posted[0]
        try:
            self.comm.check_async_error()
        except Exception as e:
            peers = sorted({op.peer for _, _, g in posted for op in g})
            self._broken(
                f"gpu:{self.gpu}: NCCL reported an error while {_what(group[0])} was in flight "
                f"(peers {', '.join(f'gpu:{p}' for p in peers)}): {e}"
            )
            return
        if now - max(at, self._progress) > self.timeout_s:
            op = group[0]
            self._broken(
                f"gpu:{self.gpu}: NCCL {_what(op)} made no progress for {self.timeout_s:g} s: "
                f"gpu:{op.peer} is lost or stalled (the communicator was aborted)"
            )

    def _broken(self, message: str) -> None:
        """Ends NCCL here: aborts the communicator (its operations end) and fails the run."""
        if self.error is not None:
            return
        self.error = message
        with contextlib.suppress(Exception):
            self.comm.abort()
        self.comm = None
        self._fail(message)
        # receives the loop handed over but never posted: back to it, with the error
        for vid in [op.vid for op in self.ops[self.cursor :] if not op.send and op.vid in self.dst]:
            self.backend.external_end(vid, RunError(message))

    def _teardown(self) -> None:
        if self.comm is None:
            return
        pending = any(not m.query() for m, _, _ in self._posted)
        with contextlib.suppress(Exception):  # a communicator whose peer died cannot be destroyed
            if pending:
                self.comm.abort()
            else:
                self.comm.destroy()
        self.comm = None

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def statistics(self) -> dict:
        return {"groups": self.groups, "operations": self.posted_ops, "error": self.error}


def _what(op: NcclOp) -> str:
    return f"transfer {op.vid} {'to' if op.send else 'from'} gpu:{op.peer}"
