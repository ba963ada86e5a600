"""GPU-to-GPU transfers for the cuda backend: CUDA IPC peer copies, NCCL, or the Ray object store.

The path is chosen per worker pair once, at setup (`connect_workers`, called by the driver after
every worker has loaded its graph), from what each worker reports of itself (`describe`):

- "ipc": both workers on one node and one physical GPU (fractional `num_gpus`: several workers
  share it, each with its own arena). Each worker exports a CUDA IPC handle of its arena (torch's
  `reduce_tensor`, cudaIpcGetMemHandle); a peer opens it once, and a transfer is one
  device-to-device copy on the destination's lane for that peer (1.41 TB/s measured between two
  Ray actors on the H100).
- "p2p": one node, two GPUs that can access each other (NVLink or PCIe peer access). Ray gives
  each actor `CUDA_VISIBLE_DEVICES` of its own GPU only, which hides the peer's device; the
  driver therefore gives all workers of a node the same list, the union of their GPUs, before
  CUDA starts in them (as Ray Train does; `shared_visible`, `GpuWorker.share_devices`), and
  each uses its own entry. The peer's arena handle is opened into this worker's device with
  cudaIpcMemLazyEnablePeerAccess (through CuPy's runtime bindings, so no context is made on
  the peer's device), and a transfer is one cudaMemcpyAsync on the destination's lane, which
  reads the peer's memory over the link.
- "nccl": GPUs without peer access, or on different nodes: one NCCL communicator per graph over
  the workers with such pairs, driven by one thread per worker in one agreed order
  (`actors.transports.nccl`). NCCL refuses two ranks on one GPU, so a GPU contributes one member
  and the others' pairs fall back to "ray".
- "ray": the last fallback, `actors.transports.objectstore.RayTransport` (bytes through the object store).

The choice, the reason a pair is left on "ray" and the driver's setup calls are
`actors.transports.paths`: a pair that falls back (no cupy, no NCCL, an arena IPC cannot export)
is logged as a warning naming it and the reason, and the run summary shows it under its path.
Each peer gets an IPC export of its own, released once (`actors.transports.ipc`), so the arena's
memory goes back to the device at unload and resize.

The run summary reports the path each pair actually opened (`connect_workers` returns it). With
the sanitizer on (`check=True`), every IPC/P2P/NCCL pull is checked after its copy completed:
the same range read through Ray, checked by the source's sanitizer, must hold the same bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc

from ..backends.base import Mode
from .base import TransportBase
from .ipc import ArenaExports, opened_at
from .nccl import TIMEOUT_S, NcclChannel, NcclOp, nccl_ops
from .objectstore import RayTransport
from .paths import (  # noqa: F401  (the path choice: its home is .paths)
    PATHS,
    Connected,
    choose_path,
    choose_paths,
    fallbacks,
    nccl_members,
    shared_visible,
)

SETUP_S = 180.0  # bound of each setup call of the driver (an NCCL communicator's creation waits up to 120 s)
log = logging.getLogger("disco_ray")
IPC_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)


IMPORT_ERRORS: dict[str, str] = {}  # "nccl", "p2p" -> why its CuPy module did not import here


def nccl_module() -> Any:
    """cupy's NCCL module, or None (imported lazily: the CPU build has no cupy)."""
    try:
        from cupy.cuda import nccl
    except Exception as e:
        IMPORT_ERRORS["nccl"] = f"cannot import cupy.cuda.nccl ({type(e).__name__}: {e})"
        return None
    return nccl


def cupy_runtime() -> Any:
    """cupy's CUDA runtime bindings, or None."""
    try:
        from cupy.cuda import runtime
    except Exception as e:
        IMPORT_ERRORS["p2p"] = f"cannot import cupy.cuda.runtime ({type(e).__name__}: {e})"
        return None
    return runtime


def nccl_available() -> bool:
    return nccl_module() is not None


def nccl_timeout() -> float:
    """Seconds a posted NCCL group may make no progress before the run fails (DISCO_NCCL_TIMEOUT_S)."""
    return float(os.environ.get("DISCO_NCCL_TIMEOUT_S", TIMEOUT_S))


# ---- one worker's transport ----------------------------------------------------------------------
class CudaTransport(TransportBase):
    """The `Transport` of one cuda worker; `attach` gives it the executor, `connect` its peers."""

    def __init__(self, gpu: int, handles: Sequence[Any]):
        self.gpu = gpu
        self.handles = handles
        self.fallback = RayTransport(handles)
        self.ex: Any = None
        self.paths: dict[int, str] = {}
        self.peers: dict[int, torch.Tensor] = {}  # ipc: the peer's arena mapped into this process
        self.p2p: dict[int, tuple[int, int]] = {}  # p2p: peer -> (mapped base pointer, arena offset)
        self.channel: NcclChannel | None = None
        self.exports = ArenaExports()  # this worker's arena exported to its peers
        self.pulls = dict.fromkeys(PATHS, 0)
        self.bytes = dict.fromkeys(PATHS, 0)
        self._check_stream: Any = None

    def attach(self, executor: Any) -> None:
        self.ex = executor

    # ---- setup ---------------------------------------------------------------------------------
    def describe(self) -> dict:
        """What the driver needs to choose paths: node, GPU uuid and index, the device list this
        process sees, the devices it can access, an IPC export of its arena per peer, NCCL and
        P2P support, and why each path it cannot take is out (`why`)."""
        dev = self.ex.arena.device
        # an export per peer, each released once (actors/transports/ipc.py); None: no IPC for it
        ipc = self.exports.make(self.ex.arena, [g for g in range(len(self.handles)) if g != self.gpu])
        n = torch.cuda.device_count()
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        p2p = ipc is not None and cupy_runtime() is not None
        nccl = nccl_available()
        why = {  # what rules a path out here, for the driver's warning and the run summary
            "ipc": self.exports.error if ipc is None else None,
            "p2p": (self.exports.error if ipc is None else IMPORT_ERRORS.get("p2p")) if not p2p else None,
            "nccl": IMPORT_ERRORS.get("nccl", "has no NCCL") if not nccl else None,
        }
        return {
            "gpu": self.gpu,
            "node": _node_id(),
            "pid": os.getpid(),
            "uuid": str(torch.cuda.get_device_properties(dev).uuid),
            "device": index,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "peer_access": [
                d for d in range(n) if d != index and torch.cuda.can_device_access_peer(index, d)
            ],
            "ipc": ipc,
            "p2p": p2p,
            "nccl": nccl,
            "why": {k: v for k, v in why.items() if v},
        }

    def nccl_id(self) -> Any:
        """A unique id for the communicator (asked of one member only: it starts NCCL's bootstrap)."""
        return nccl_module().get_unique_id()

    def connect(
        self, infos: Sequence[dict], paths: dict[tuple[int, int], str], nccl_uid: Any = None
    ) -> dict[int, str]:
        """Opens the IPC handles of this worker's pairs and its NCCL channel (its communicator's
        creation blocks until every member joins, so the driver calls every worker's `connect`
        at once); the exports of this worker's arena that no peer rebuilds are released here.
        Returns {peer: path opened}."""
        me = self.gpu
        mine = {}  # peer -> the path of the pair
        for (i, j), path in sorted(paths.items()):
            if me in (i, j):
                peer = j if me == i else i
                # a process cannot open its own IPC handle (the local engine never gets here)
                same = path in ("ipc", "p2p") and infos[peer]["pid"] == os.getpid()
                mine[peer] = "ray" if same else path
        # the ipc peers rebuild this worker's export (torch releases it with their copy)
        self.exports.settle(p for p, path in mine.items() if path == "ipc")
        for peer, path in mine.items():
            if path == "ipc":
                rebuild, args = infos[peer]["ipc"][me]
                with torch.cuda.device(self.ex.arena.device):
                    self.peers[peer] = rebuild(*args)
            elif path == "p2p":
                self.p2p[peer] = _open_peer(infos[peer]["ipc"][me], self.ex.arena.device)
            self.paths[peer] = path
        nccl_peers = sorted(p for p, path in self.paths.items() if path == "nccl")
        if nccl_peers:
            members = nccl_members(paths)
            ex = self.ex
            self.channel = NcclChannel(
                me,
                {g: r for r, g in enumerate(members)},
                nccl_uid,
                nccl_peers,
                nccl_ops(ex.mg, me, nccl_peers),
                nccl_module(),
                ex.arena.device,
                ex.fail,
                nccl_timeout(),
            )
            self.channel.start(ex.backend, ex.backend.stream(ex.deferred_lane), self._source)
        return dict(self.paths)

    def _source(self, op: NcclOp) -> torch.Tensor:
        return self.ex.views.buf(op.loc, op.vid)

    # ---- a run ---------------------------------------------------------------------------------
    def mode(self, src_gpu: int) -> Mode:
        """IPC and P2P enqueue one copy; NCCL hands the receive to the channel; Ray waits for the
        bytes on the host."""
        path = self.paths.get(src_gpu, "ray")
        if path in ("ipc", "p2p"):
            return Mode.LAUNCH
        return Mode.DEFERRED if path == "nccl" else Mode.BLOCKING

    def set_timeout(self, seconds: float | None) -> None:
        self.fallback.set_timeout(seconds)  # its pulls, and the sanitizer's reads through Ray

    def begin_run(self) -> None:
        if self.channel is not None:
            self.channel.begin_run()

    def watched(self) -> set[int]:
        return self.channel.watched() if self.channel is not None else set()

    def completed(self, vid: int) -> None:
        if self.channel is not None:
            self.channel.source_done(vid)

    def pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        path = self.paths.get(src_gpu, "ray")
        self.pulls[path] += 1
        self.bytes[path] += loc.nbytes
        if path == "ipc":
            dst.copy_(self.peers[src_gpu][loc.offset : loc.end], non_blocking=True)
        elif path == "p2p":
            base, off = self.p2p[src_gpu]
            stream = torch.cuda.current_stream()
            cupy_runtime().memcpyAsync(
                dst.data_ptr(), base + off + loc.offset, loc.nbytes, MEMCPY_DEFAULT, stream.cuda_stream
            )
        elif path == "nccl":
            assert self.channel is not None
            self.channel.post_recv(reader, dst)
        else:
            self.fallback.pull(src_gpu, loc, dst, reader, expect)

    def after_pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        """With the sanitizer on, once a fast-path pull completed: the same range read through Ray
        (the source's sanitizer checks that read) must hold the bytes that arrived."""
        path = self.paths.get(src_gpu, "ray")
        if path == "ray" or self.ex is None or not self.ex._check:
            return
        if self._check_stream is None:
            self._check_stream = torch.cuda.Stream(dst.device)
        with torch.cuda.stream(self._check_stream):  # a stream nothing else waits on
            got = dst.to("cpu")
        ref = torch.empty(loc.nbytes, dtype=torch.uint8)
        self.fallback.pull(src_gpu, loc, ref, reader, expect)
        if not torch.equal(got, ref):
            raise RunError(
                f"gpu:{self.gpu}: transfer {reader} from gpu:{src_gpu} over {path} copied bytes that "
                f"differ from the source range [{loc.offset}, {loc.end})"
            )

    def probe(self, src_gpu: int, nbytes: int) -> bool:
        """One copy of `nbytes` (at most the arenas' size) from the peer's arena into this one's,
        waited for: what `disco_ray.driver.cluster.measure_links` times. False: the pair's path
        has no one-sided copy (NCCL, Ray)."""
        path = self.paths.get(src_gpu, "ray")
        if path not in ("ipc", "p2p"):
            return False
        n = min(nbytes, self.ex.arena.numel())
        dst = self.ex.arena[:n]
        stream = torch.cuda.Stream(dst.device)
        with torch.cuda.stream(stream):
            if path == "ipc":
                dst.copy_(self.peers[src_gpu][:n], non_blocking=True)
            else:
                base, off = self.p2p[src_gpu]
                cupy_runtime().memcpyAsync(dst.data_ptr(), base + off, n, MEMCPY_DEFAULT, stream.cuda_stream)
        stream.synchronize()
        return True

    def statistics(self) -> dict:
        out = {
            "paths": {str(k): v for k, v in sorted(self.paths.items())},
            "pulls": self.pulls,
            "bytes": self.bytes,
            "ipc_exports": self.exports.statistics(),
        }
        if self.channel is not None:
            out["nccl"] = self.channel.statistics()
        return out

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.peers.clear()
        rt = cupy_runtime()
        for base, _ in self.p2p.values():
            with contextlib.suppress(Exception):
                rt.ipcCloseMemHandle(base)
        self.p2p.clear()
        self.exports.close()  # exports no peer took over (connect never came)


def _open_peer(ipc: Any, device: torch.device) -> tuple[int, int]:
    """Maps a peer's arena (torch's IPC export of it) into `device`: (base pointer, offset of the
    arena in the mapped allocation). Peer access is enabled as needed (lazily) by CUDA."""
    handle, offset = opened_at(ipc)
    rt = cupy_runtime()
    with torch.cuda.device(device):
        base = rt.ipcOpenMemHandle(handle, IPC_LAZY_PEER_ACCESS)
    return base, offset


def connect_workers(
    workers: Sequence[Any], key: str, allow: Sequence[str] = PATHS, timeout_s: float = SETUP_S
) -> Connected:
    """Driver side: chooses the path of every worker pair of graph `key`, has the workers open
    them, and logs a warning for each pair left on Ray's object store, naming it and why.
    DISCO_CUDA_PATHS (comma-separated) narrows `allow`. Each call is bounded by `timeout_s`."""
    import ray

    if "DISCO_CUDA_PATHS" in os.environ:  # e.g. "ray": force the fallback (tests, debugging)
        allow = tuple(os.environ["DISCO_CUDA_PATHS"].split(","))
    infos = ray.get([w.transport_describe.remote(key) for w in workers], timeout=timeout_s)
    paths = choose_paths(infos, allow)
    why = fallbacks(infos, paths, allow)
    members = nccl_members(paths)
    uid = ray.get(workers[members[0]].transport_nccl_id.remote(key), timeout=timeout_s) if members else None
    opened = ray.get([w.transport_connect.remote(key, infos, paths, uid) for w in workers], timeout=timeout_s)
    out: dict[str, str] = {}
    for g, got in enumerate(opened):
        for peer, path in got.items():
            pair = (min(g, peer), max(g, peer))
            out[f"{pair[0]}-{pair[1]}"] = path
            if path == "ray" and pair not in why:  # ipc/p2p chosen, but both in one process
                why[pair] = (
                    f"{paths[pair]}: both workers run in one process (it cannot open its own IPC handle)"
                )
    for (i, j), r in sorted(why.items()):
        log.warning("gpu:%d and gpu:%d: transfers go through Ray's object store: %s", i, j, r)
    return Connected(dict(sorted(out.items())), {f"{i}-{j}": r for (i, j), r in sorted(why.items())})


def disconnect_workers(workers: Sequence[Any], key: str, timeout_s: float) -> None:
    """Driver side, before graph `key` is unloaded: every worker closes its mappings of its
    peers' arenas first, so that no arena is freed while a peer still maps it (torch would then
    hold it for IPC until a later collect: actors/transports/ipc.py)."""
    import ray

    ray.get([w.transport_close.remote(key) for w in workers], timeout=timeout_s)


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return socket.gethostname()
