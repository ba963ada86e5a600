"""The spill file: the disk tier below a worker's host store (MemGraph locations
`{"device": "disk"}`), written behind and read ahead.

Offloads that find the host store full go here (the planner's host budget). `SpillFile` writes
each offload's range through bounce buffers on a writer thread and reads ranges back; `ReadAhead`
reads the plan's upcoming reloads into staging buffers before their vertices run. Both move whole
ALIGN-aligned blocks with O_DIRECT where the file system allows it (`actors.tiers.diskio`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from disco_ray.graph.errors import RunError

from .diskio import ALIGN, aligned, preallocate
from .sweep import TEMP_PREFIX, spill_name

CHUNK = 16 << 20  # the largest spill-file I/O: a bounce buffer's size (a multiple of ALIGN)


def _memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A host copy in this thread: torch's copy_ splits a large one over its thread pool, which on
    a busy machine waits for cores (6 ms for 1 MiB on 2 loaded cores, against 0.04 ms here)."""
    np.copyto(dst.numpy(), src.numpy())


class _Pending:
    """A chunk handed to the writer thread: its bounce buffer, until it is in the file."""

    __slots__ = ("buf", "done", "end", "offset", "span")

    def __init__(self, offset: int, span: int, buf: torch.Tensor):
        self.offset, self.span, self.end, self.buf = offset, span, offset + span, buf
        self.done = threading.Event()


class SpillFile:
    """One worker's spill file: the disk tier below its host store (MemGraph locations
    `{"device": "disk"}`, offsets into this file).

    Preallocated when the graph is loaded, in `directory` (None: a temporary directory, removed
    with the file by `close`). Offloads write and reloads read whole ALIGN-aligned blocks (the
    planner aligns every disk range to ALIGN) through bounce buffers, with O_DIRECT where the file
    system allows it (so the page cache neither hides the cost nor fills host memory), buffered
    where it does not; a value larger than `chunk` bytes moves a chunk at a time, so bounce
    buffers stay small whatever the tensors.

    Write-behind (the saving thread of the nntrainer design: loading, working and saving
    overlapped): an offload only copies its range into a free bounce buffer and hands it to this
    file's writer thread, so the arena range, and the compute waiting for it, is free at memcpy
    speed; with every buffer in flight an offload waits for one (back-pressure). A read first
    waits for the pending writes that overlap its range, so a reload always reads what its
    offload wrote, from the file. On CUDA the bounce buffers are pinned: an offload waits for the
    device-to-host copy before handing the buffer on; a reload waits for the host-to-device copy
    before its buffer is reused. Counts bytes and seconds of the file I/O alone.
    """

    def __init__(
        self,
        directory: str | None,
        gpu: int,
        nbytes: int,
        largest: int,
        alloc: Callable[[int, bool], torch.Tensor],
        buffers: int = 2,
        direct: bool = True,
        chunk: int = CHUNK,
    ):
        self.tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX) if directory is None else None
        directory = self.tmp or str(directory)
        self.path = os.path.join(directory, spill_name(gpu, os.getpid()))  # the pool's sweep finds it
        self.nbytes = -(-nbytes // ALIGN) * ALIGN
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise RunError(
                f"gpu:{gpu}: cannot make its spill file in {directory} (the disk directory): {e.strerror}"
            ) from None
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []  # handed to the writer, not in the file yet (FIFO)
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._writer: threading.Thread | None = None
        self._retired: list[int] = []  # O_DIRECT descriptors given up on (closed with the file)
        self.dfd: int | None = None
        self.fd = fd
        try:
            preallocate(self.fd, self.nbytes, f"gpu:{gpu}: spill file {self.path}")
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self.dfd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
                except OSError:  # tmpfs and some network file systems: buffered
                    self.dfd = None
            span = min(-(-largest // ALIGN) * ALIGN, max(ALIGN, chunk // ALIGN * ALIGN))
            self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
            self.buffer_bytes = max(2, buffers) * span
            for _ in range(max(2, buffers)):  # at least one to write behind and one to read
                self._free.put(aligned(span, alloc))
        except BaseException:
            self.close()
            raise
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name=f"spill-writer-{gpu}")
        self._writer.start()
        self.reset()

    @property
    def direct(self) -> bool:
        return self.dfd is not None

    def reset(self) -> None:
        """Zeroes the counters (a new run; call `flush` first)."""
        self.bytes_written = self.bytes_read = 0
        self.write_s = self.read_s = 0.0
        self.writes = self.reads = 0

    def _io(self, write: bool, offset: int, view: memoryview) -> None:
        need = len(view)
        if offset + need > self.nbytes:
            raise RunError(
                f"spill file {self.path}: range [{offset}, {offset + need}) beyond its {self.nbytes} bytes"
            )
        while True:
            fd = self.dfd if self.dfd is not None else self.fd
            try:
                done = 0
                while done < need:
                    part = [view[done:]]
                    n = os.pwritev(fd, part, offset + done) if write else os.preadv(fd, part, offset + done)
                    if n <= 0:
                        raise RunError(f"spill file {self.path}: short {'write' if write else 'read'}")
                    done += n
                return
            except OSError as e:
                if fd == self.fd or e.errno not in (22, 95):  # EINVAL, EOPNOTSUPP: no O_DIRECT
                    raise
                with self._lock:  # buffered from now on; the other thread may still use fd
                    if self.dfd == fd:
                        self._retired.append(fd)
                        self.dfd = None

    def _check(self) -> None:
        if (e := self._error) is not None:  # a full disk: ENOSPC (or EFBIG past a file-size limit)
            raise RunError(f"spill file {self.path}: a write failed: {getattr(e, 'strerror', None) or e}")

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                t = time.perf_counter()
                self._io(True, item.offset, memoryview(item.buf.numpy()).cast("B")[: item.span])  # type: ignore[arg-type]
                self.write_s += time.perf_counter() - t
                self.bytes_written += item.span
            except BaseException as e:  # raised by the next write, read or flush
                self._error = e
            with self._lock:
                self._pending.remove(item)
            item.done.set()
            self._free.put(item.buf)

    def write(self, offset: int, src: torch.Tensor) -> None:
        """Writes the uint8 range `src` (arena bytes) at `offset` of the file: copies it into bounce
        buffers, a chunk each, and returns; the writer thread puts them in the file."""
        self._check()
        n, at = src.numel(), 0
        while at < n:
            buf = self._free.get()
            k = min(buf.numel(), n - at)
            part = src[at : at + k]
            try:
                if part.is_cuda:  # the bounce buffer must hold the bytes before the file gets them
                    buf[:k].copy_(part)
                    torch.cuda.current_stream(part.device).synchronize()
                else:
                    _memcpy(buf[:k], part)
            except BaseException:
                self._free.put(buf)
                raise
            item = _Pending(offset + at, -(-k // ALIGN) * ALIGN, buf)
            with self._lock:
                self._pending.append(item)
            self._queue.put(item)
            at += k
        self.writes += 1

    def _wait_for(self, lo: int, hi: int) -> None:
        """Waits until no write pending over [lo, hi) is left."""
        with self._lock:
            waits = [p for p in self._pending if p.offset < hi and lo < p.end]
        for p in waits:
            p.done.wait()
        self._check()

    def read(
        self, offset: int, dst: torch.Tensor, copy: Callable[[torch.Tensor, torch.Tensor], object]
    ) -> None:
        """Reads `dst.numel()` bytes at `offset` of the file into the uint8 range `dst`, a chunk at a
        time (on a device with `copy`, the backend's), once the writes pending there are in."""
        n = dst.numel()
        self._wait_for(offset, offset + n)
        buf = self._free.get()
        try:
            chunk = buf.numel()
            for at in range(0, n, chunk):
                k = min(chunk, n - at)
                span = -(-k // ALIGN) * ALIGN
                t = time.perf_counter()
                self._io(False, offset + at, memoryview(buf.numpy()).cast("B")[:span])  # type: ignore[arg-type]
                self.read_s += time.perf_counter() - t
                self.bytes_read += span
                part = dst[at : at + k]
                if part.is_cuda:  # the bounce buffer is free again only once the copy has read it
                    copy(part, buf[:k])
                    torch.cuda.current_stream(part.device).synchronize()
                else:
                    _memcpy(part, buf[:k])
            self.reads += 1
        finally:
            self._free.put(buf)

    def read_raw(self, offset: int, nbytes: int, buf: torch.Tensor) -> None:
        """Reads the whole blocks of [offset, offset + nbytes) into `buf` (ALIGN-aligned, at least
        that many whole blocks), once the writes pending there are in."""
        span = -(-nbytes // ALIGN) * ALIGN
        self._wait_for(offset, offset + nbytes)
        t = time.perf_counter()
        self._io(False, offset, memoryview(buf.numpy()).cast("B")[:span])  # type: ignore[arg-type]
        self.read_s += time.perf_counter() - t
        self.bytes_read += span
        self.reads += 1

    def flush(self) -> None:
        """Waits until every write handed to the writer is in the file (RunError if one failed)."""
        self._wait_for(0, 1 << 62)

    def statistics(self) -> dict:
        """This run's disk I/O: bytes, seconds and GB/s each way (file I/O alone, no copies)."""
        return {
            "path": self.path,
            "file_bytes": self.nbytes,
            "buffer_bytes": self.buffer_bytes,
            "direct": self.direct,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "writes": self.writes,
            "reads": self.reads,
            "write_s": round(self.write_s, 6),
            "read_s": round(self.read_s, 6),
            "write_gb_per_s": round(self.bytes_written / self.write_s / 1e9, 3) if self.write_s else None,
            "read_gb_per_s": round(self.bytes_read / self.read_s / 1e9, 3) if self.read_s else None,
        }

    def close(self) -> None:
        """Stops the writer (after the writes handed to it) and removes the file (and the
        temporary directory it made)."""
        w, self._writer = self._writer, None
        if w is not None:
            self._queue.put(None)
            if w is not threading.current_thread():
                w.join(timeout=60)
        for fd in (self.dfd, self.fd, *self._retired):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.dfd, self.fd, self._retired = None, -1, []  # a second close must not close a reused descriptor
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


class ReadAhead:
    """Reads a worker's reloads from disk ahead of time, into staging buffers of its own.

    At a tight arena a reload's range frees only just before its reader runs, so a reload that
    read the file only then would put the disk's latency on the critical path. This thread
    follows the plan's reloads from disk in id order (the planner's serial order): once a
    reload's offload has run in this run (`written`), it reads the range into a free staging
    buffer; the reload vertex then only copies it into the arena (`take`), or reads the file
    itself when the read-ahead has not got there (then the thread drops its copy). Correct
    because no vertex writes a disk range between its offload and the last reload of it (a
    MemGraph condition the verifier checks), and each read waits for the pending writes over its
    range. `buffers` staging buffers of the largest such value bound how far ahead it reads: host
    memory beyond the host budget, reported in `statistics`.

    Args:
        spill: the worker's spill file.
        items: (reload vertex, its offload vertex, file offset, bytes) in the order to read.
    """

    def __init__(
        self,
        spill: SpillFile,
        items: list[tuple[int, int, int, int]],
        alloc: Callable[[int, bool], torch.Tensor],
        buffers: int = 2,
    ):
        self.spill = spill
        self.items = [it for it in items if it[3] <= CHUNK]  # larger values are read by their reload
        largest = max((it[3] for it in self.items), default=0)
        span = -(-largest // ALIGN) * ALIGN
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self.buffers = buffers if self.items else 0
        for _ in range(self.buffers):
            self._free.put(aligned(span, alloc))
        self.staging_bytes = self.buffers * span
        self._cv = threading.Condition()
        self._gen = 0  # bumps at every begin and end: the thread drops what it was doing
        self._active = False
        self._closing = False
        self._written: dict[int, threading.Event] = {}
        self._ready: dict[int, torch.Tensor] = {}
        self._taken: set[int] = set()
        self.hits = self.misses = 0
        self._thread: threading.Thread | None = None
        if self.items:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="spill-read-ahead")
            self._thread.start()

    def begin(self) -> None:
        """A new run: nothing is written or read ahead yet."""
        with self._cv:
            self._drop()
            self._written = {it[1]: threading.Event() for it in self.items}
            self._taken = set()
            self.hits = self.misses = 0
            self._active = True
            self._cv.notify_all()

    def end(self) -> None:
        """The run is over (or failed): the thread stops and gives its buffers back."""
        with self._cv:
            self._drop()
            self._active = False

    def _drop(self) -> None:
        # caller holds the condition's lock
        self._gen += 1
        for buf in self._ready.values():
            self._free.put(buf)
        self._ready = {}

    def written(self, offload: int) -> None:
        """Offload vertex `offload` has handed its bytes to the spill file in this run."""
        ev = self._written.get(offload)
        if ev is not None:
            ev.set()

    def take(
        self, reload: int, dst: torch.Tensor, copy: Callable[[torch.Tensor, torch.Tensor], object]
    ) -> bool:
        """Copies reload `reload`'s bytes into `dst` if they were read ahead (True); else marks it
        taken, so the thread drops its copy, and returns False (the caller reads the file)."""
        with self._cv:
            buf = self._ready.pop(reload, None)
            self._taken.add(reload)
            if buf is None:
                self.misses += 1
                return False
            self.hits += 1
        try:
            n = dst.numel()
            if dst.is_cuda:  # the staging buffer is free again only once the copy has read it
                copy(dst, buf[:n])
                torch.cuda.current_stream(dst.device).synchronize()
            else:
                _memcpy(dst, buf[:n])
        finally:
            self._free.put(buf)
        return True

    def _current(self, gen: int) -> bool:
        return gen == self._gen and not self._closing

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._active or self._closing):
                    self._cv.wait()
                if self._closing:
                    return
                gen, written = self._gen, self._written
            for reload, offload, offset, nbytes in self.items:
                ev = written[offload]
                while not ev.wait(0.05):
                    if not self._current(gen):
                        break
                buf = None
                while self._current(gen) and buf is None:
                    with contextlib.suppress(queue.Empty):
                        buf = self._free.get(timeout=0.05)
                if buf is None:
                    break
                with self._cv:
                    wanted = self._current(gen) and reload not in self._taken
                if wanted:
                    try:
                        self.spill.read_raw(offset, nbytes, buf)
                    except BaseException:  # the reload reads the file itself, and raises there
                        wanted = False
                with self._cv:
                    if wanted and self._current(gen) and reload not in self._taken:
                        self._ready[reload] = buf
                        buf = None
                if buf is not None:
                    self._free.put(buf)
            with self._cv:  # every item seen: wait for the next run
                if self._gen == gen:
                    self._active = False

    def statistics(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "staging_bytes": self.staging_bytes}

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._drop()
            self._cv.notify_all()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=10)
