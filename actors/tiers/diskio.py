"""Disk I/O at the disk's speed: graph inputs read from their files when the plan loads them (the
spill file that offloads go to once the host store is full is `actors.tiers.spill`).

A worker that streams its sourced inputs (`WorkerConfig.sources == "disk"`) keeps no copy of them
in host memory: each load vertex reads its block of the safetensors file into a bounce buffer and
copies it into the arena (on CUDA: the bounce buffer is pinned, the copy is host-to-device). The
reads go in large aligned blocks through O_DIRECT where the file system allows it (so the page
cache neither hides the cost nor fills host memory with the model), buffered where it does not
(tmpfs, some network file systems). Bounce buffers are made when the graph is loaded, two per
worker by default, each the size of the largest block: loads on several lanes take turns on them.

A quantized source (`Source.quant`) is read and packed once, when the graph is loaded, into a file
of the worker's own (`packed_file`): its loads then read the packed bytes, never the float ones.
One whose file holds it packed already (`Source.packed`: a `disco-ray quantize` checkpoint) is
read from that file as any other block: no quantization at all.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disco_ray.graph import sources
from disco_ray.graph.dtypes import torch_dtype
from disco_ray.graph.errors import RunError
from disco_ray.graph.quant import Quant
from disco_ray.graph.taskgraph import Vertex

ALIGN = 4096  # O_DIRECT's alignment of offsets, sizes and buffer addresses on common file systems


def aligned(nbytes: int, alloc: Callable[[int, bool], torch.Tensor]) -> torch.Tensor:
    """A uint8 host buffer of `nbytes` whose address is a multiple of ALIGN (from `alloc`)."""
    raw = alloc(nbytes + ALIGN, True)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off : off + nbytes]


def preallocate(fd: int, nbytes: int, where: str) -> None:
    """Gives file `fd` its `nbytes` on disk now, so that a full disk is found before a run, not
    in the middle of it; a sparse file where the file system cannot preallocate.

    Raises:
        RunError: naming `where`: no room for it (ENOSPC, a quota, a file-size limit).
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise RunError(f"{where}: no room for its {nbytes} bytes ({e.strerror})") from None
        os.ftruncate(fd, nbytes)  # EOPNOTSUPP, EINVAL: no fallocate here


class FileReader:
    """Reads byte ranges of files, O_DIRECT where it works; counts bytes and seconds."""

    def __init__(self, direct: bool = True):
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._fds: dict[str, tuple[int, bool]] = {}
        self._lock = threading.Lock()
        self.bytes = 0  # the bytes asked for
        self.io_bytes = 0  # the bytes read (whole aligned blocks)
        self.seconds = 0.0
        self.direct_reads = 0
        self.buffered_reads = 0
        # blocks of `finite` sources found finite (with their file's version): not checked again
        self.checked: set[tuple] = set()

    def _fd(self, path: str, direct: bool) -> int:
        got = self._fds.get(path)
        if got is not None and got[1] == direct:
            return got[0]
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags)
        if got is not None:
            os.close(got[0])
        self._fds[path] = (fd, direct)
        return fd

    def read(self, path: str, offset: int, nbytes: int, buf: torch.Tensor) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of `path`, as a view into `buf` (aligned, at least
        `span(offset, nbytes)` bytes)."""
        start = offset - offset % ALIGN
        end = -(-(offset + nbytes) // ALIGN) * ALIGN
        view = memoryview(buf.numpy()).cast("B")[: end - start]  # type: ignore[arg-type]
        t = time.perf_counter()
        with self._lock:
            direct = self.direct and self._fds.get(path, (0, True))[1]
            try:
                got = self._read_all(self._fd(path, direct), view, start, offset + nbytes - start)
            except OSError as e:
                if not direct or e.errno not in (22, 95):  # EINVAL, EOPNOTSUPP: no O_DIRECT here
                    raise
                got = self._read_all(self._fd(path, False), view, start, offset + nbytes - start)
                direct = False
            if direct:
                self.direct_reads += 1
            else:
                self.buffered_reads += 1
            self.bytes += nbytes
            self.io_bytes += got
            self.seconds += time.perf_counter() - t
        return buf[offset - start : offset - start + nbytes]

    @staticmethod
    def _read_all(fd: int, view: memoryview, start: int, need: int) -> int:
        got = 0
        while got < need:
            n = os.preadv(fd, [view[got:]], start + got)
            if n <= 0:
                raise RunError(f"short read: {got} of {need} bytes")
            got += n
        return got

    def statistics(self) -> dict:
        return {
            "bytes_read": self.bytes,
            "io_bytes": self.io_bytes,
            "read_s": round(self.seconds, 6),
            "read_gb_per_s": round(self.io_bytes / self.seconds / 1e9, 3) if self.seconds else None,
            "direct_reads": self.direct_reads,
            "buffered_reads": self.buffered_reads,
        }

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


_PACKED: dict[str, str] = {}  # the packed files this process wrote: source key -> path


def packed_file(v: Vertex) -> str:
    """A file of this process's temporary directory holding sourced input `v`'s packed bytes
    (quantized from its checkpoint block at the first call, then reused)."""
    assert v.source is not None
    key = repr((v.source, v.shape, v.dtype))
    path = _PACKED.get(key)
    if path is not None and os.path.exists(path):
        return path
    if "dir" not in _PACKED:
        _PACKED["dir"] = tempfile.mkdtemp(prefix="disco-packed-")
        atexit.register(shutil.rmtree, _PACKED["dir"], True)
    t = sources.read(v.source, v.shape, v.dtype, f"input {v.id!r}")
    path = os.path.join(_PACKED["dir"], hashlib.sha1(key.encode()).hexdigest() + ".bin")
    t.numpy().tofile(path)
    _PACKED[key] = path
    return path


@dataclass(frozen=True, slots=True)
class FileBlock:
    """Where a sourced input's block lies in its file: whole rows [offset, offset + nbytes) of
    `rows` x `cols` elements of `file_dtype`, of which columns [c0, c1) are the block."""

    path: str
    offset: int
    nbytes: int
    rows: tuple[int, ...]  # the rows' shape (leading dims sliced)
    file_dtype: str
    cols: tuple[int, int] | None
    finite: bool = False  # the source's: its values are checked (`sources.check_finite`)
    what: str = ""  # the input and its source, for messages
    version: tuple[int, int] = (0, 0)  # the file's (mtime_ns, size) when the header was read
    packed: tuple[Quant, int] | None = None  # stored packed: how, and the float rows' length

    @classmethod
    def of(cls, v: Vertex) -> FileBlock:
        assert v.source is not None
        src = v.source
        where = f"input {v.id!r}"
        if src.packed:
            block = cls._stored(src, f"{where}: source {src.describe()}")
            if block.packed is not None and block.packed[0] == src.quant:  # else rearranged once, below
                return block
        if src.quant is not None:
            path = packed_file(v)
            st = os.stat(path)
            what = f"{where}: source {src.describe()}"
            return cls(path, 0, st.st_size, v.shape, "uint8", None, False, what, (st.st_mtime_ns, st.st_size))
        h = sources.header(src.path, where)
        meta = h.get(src.tensor)
        if not isinstance(meta, dict):
            raise RunError(f"{where}: source {src.describe()}: the file has no tensor {src.tensor!r}")
        dtype = sources.FILE_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise RunError(f"{where}: source {src.describe()}: unsupported file dtype {meta['dtype']}")
        full = tuple(meta["shape"])
        begin = h["__data_start__"] + meta["data_offsets"][0]
        item = torch_dtype(dtype).itemsize
        sl = list(src.slices) + [None] * (len(full) - len(src.slices))
        if any(s is not None for s in sl[2:]) or len(full) == 0:
            raise RunError(f"{where}: source {src.describe()}: only the first two dims may be sliced")
        r0, r1 = sl[0] if sl and sl[0] is not None else (0, full[0])
        row = item
        for d in full[1:]:
            row *= d
        cols = sl[1] if len(sl) > 1 else None
        shape = (r1 - r0, *full[1:])
        if cols is not None and (cols[1] > full[1]):
            raise RunError(f"{where}: source {src.describe()}: columns {cols[0]}:{cols[1]} exceed {full[1]}")
        what = f"{where}: source {src.describe()}"
        st = os.stat(src.path)
        version = (st.st_mtime_ns, st.st_size)
        return cls(src.path, begin + r0 * row, (r1 - r0) * row, shape, dtype, cols, src.finite, what, version)

    @classmethod
    def _stored(cls, src: sources.Source, what: str) -> FileBlock:
        """The block of a tensor its file holds packed: whole packed rows (`what`: for messages)."""
        assert src.quant is not None
        h = sources.header(src.path, what)
        meta = h.get(src.tensor)
        if not isinstance(meta, dict):
            raise RunError(f"{what}: the file has no tensor {src.tensor!r}")
        b = sources.StoredBlock.of(src, h.get("__metadata__"), meta["dtype"], meta["shape"], what)
        st = os.stat(src.path)
        begin = h["__data_start__"] + meta["data_offsets"][0] + b.r0 * b.width
        rows = (b.r1 - b.r0, b.width)
        version = (st.st_mtime_ns, st.st_size)
        return cls(
            src.path,
            begin,
            rows[0] * b.width,
            rows,
            "uint8",
            b.block,
            False,
            what,
            version,
            (b.stored, b.cols),
        )

    def copy_into(
        self, raw: torch.Tensor, out: torch.Tensor, dtype: str, shape: tuple[int, ...], check: bool = False
    ) -> None:
        """The block from its file bytes `raw` into `out` (uint8 view of `shape` x `dtype`);
        `check`: NonFiniteError naming the tensor unless every value is finite."""
        t = raw.view(torch_dtype(self.file_dtype)).view(self.rows)
        if self.packed is not None and self.cols is not None:  # its codes, scales and zeros
            t = sources.packed_columns(t, self.packed[0], self.packed[1], self.cols)
        elif self.cols is not None:
            t = t[:, self.cols[0] : self.cols[1]]
        typed = out.view(torch_dtype(dtype)).view(shape)
        typed.copy_(t)
        if check:  # on the arena's copy: a dtype conversion's overflow counts too
            sources.check_finite(typed, self.what, t)


class Streams:
    """The streamed sourced inputs of one graph on one worker: their file blocks, the bounce
    buffers and the reader."""

    def __init__(
        self,
        inputs: list[Vertex],
        reader: FileReader,
        alloc: Callable[[int, bool], torch.Tensor],
        buffers: int = 2,
    ):
        self.blocks = {v.id: FileBlock.of(v) for v in inputs}
        self.vertex = {v.id: v for v in inputs}
        self.reader = reader
        span = max((b.nbytes + 2 * ALIGN for b in self.blocks.values()), default=0)
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for _ in range(buffers if self.blocks else 0):
            self._free.put(aligned(span, alloc))

    def __contains__(self, value: object) -> bool:
        return value in self.blocks

    def load(self, value: str, out: torch.Tensor) -> None:
        """Reads input `value`'s block from its file into `out` (its uint8 arena range)."""
        b, v = self.blocks[value], self.vertex[value]
        buf = self._free.get()
        try:
            raw = self.reader.read(b.path, b.offset, b.nbytes, buf)
            # checked at its first read only: checking every read cost a fifth of a decode step
            key = (b.path, b.version, b.offset, b.nbytes, b.cols, v.dtype)
            check = b.finite and key not in self.reader.checked
            b.copy_into(raw, out, v.dtype, v.shape, check)
            if check:
                self.reader.checked.add(key)
            if out.is_cuda:  # the bounce buffer is free again only once the copy has read it
                torch.cuda.current_stream(out.device).synchronize()
        finally:
            self._free.put(buf)
