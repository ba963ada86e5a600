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

The run summary reports the path each pair actually opened (`connect_workers` returns it). With
the sanitizer on (`check=True`), every IPC/P2P/NCCL pull is checked after its copy completed:
the same range read through Ray, checked by the source's sanitizer, must hold the same bytes.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc

from ..backends.base import Mode
from .base import TransportBase
from .nccl import TIMEOUT_S, NcclChannel, NcclOp, nccl_ops
from .objectstore import RayTransport

PATHS = ("ipc", "p2p", "nccl", "ray")
IPC_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)


def nccl_module() -> Any:
    """cupy's NCCL module, or None (imported lazily: the CPU build has no cupy)."""
    try:
        from cupy.cuda import nccl
    except Exception:
        return None
    return nccl


def cupy_runtime() -> Any:
    """cupy's CUDA runtime bindings, or None."""
    try:
        from cupy.cuda import runtime
    except Exception:
        return None
    return runtime


def nccl_available() -> bool:
    return nccl_module() is not None


def nccl_timeout() -> float:
    """Seconds a posted NCCL group may make no progress before the run fails (DISCO_NCCL_TIMEOUT_S)."""
    return float(os.environ.get("DISCO_NCCL_TIMEOUT_S", TIMEOUT_S))


# ---- choosing paths (pure) ------------------------------------------------------------------------
def choose_path(a: dict, b: dict, allow: Sequence[str] = PATHS) -> str:
    """The transfer path between two workers described by `describe` (pure)."""
    same_node = a["node"] == b["node"]
    same_gpu = a["uuid"] == b["uuid"]
    if "ipc" in allow and same_node and same_gpu and a["ipc"] and b["ipc"]:
        return "ipc"
    if "p2p" in allow and same_node and not same_gpu and _peers(a, b) and _peers(b, a):
        return "p2p"
    if "nccl" in allow and not same_gpu and a["nccl"] and b["nccl"]:
        return "nccl"
    return "ray"


def _peers(a: dict, b: dict) -> bool:
    """`a` can read `b`'s arena: both see the same device list, and `a`'s device can access `b`'s."""
    return bool(
        a.get("ipc")
        and a.get("p2p")
        and a.get("visible")
        and a.get("visible") == b.get("visible")
        and b.get("device") in a.get("peer_access", ())
    )


def choose_paths(infos: Sequence[dict], allow: Sequence[str] = PATHS) -> dict[tuple[int, int], str]:
    """Path of every unordered pair (i < j) of workers. NCCL pairs whose worker shares its GPU with
    a worker already in the communicator (NCCL allows one rank per GPU) go through Ray instead."""
    n = len(infos)
    paths = {(i, j): choose_path(infos[i], infos[j], allow) for i in range(n) for j in range(i + 1, n)}
    member_of: dict[str, int] = {}  # GPU uuid -> the worker that is its NCCL rank
    for (i, j), path in sorted(paths.items()):
        if path != "nccl":
            continue
        if all(member_of.setdefault(infos[w]["uuid"], w) == w for w in (i, j)):
            continue
        paths[(i, j)] = "ray"
    return paths


def nccl_members(paths: dict[tuple[int, int], str]) -> list[int]:
    """The workers of the communicator (rank = position): those with an NCCL pair."""
    return sorted({w for pair, p in paths.items() if p == "nccl" for w in pair})


def shared_visible(assigned: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[str, int]]:
    """For workers given (node, the GPU ids Ray assigned to it): the CUDA_VISIBLE_DEVICES all
    workers of that node share (the union of their ids, in order) and the index of each worker's
    own GPU in it (pure)."""
    union: dict[str, list[str]] = {}
    for node, ids in assigned:
        seen = union.setdefault(node, [])
        for g in ids:
            if str(g) not in seen:
                seen.append(str(g))
    for ids in union.values():
        ids.sort(key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g))
    out = []
    for node, ids in assigned:
        if not ids:
            raise RunError(f"a worker on node {node} was given no GPU by Ray")
        out.append((",".join(union[node]), union[node].index(str(ids[0]))))
    return out


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
        self.pulls = dict.fromkeys(PATHS, 0)
        self.bytes = dict.fromkeys(PATHS, 0)
        self._check_stream: Any = None

    def attach(self, executor: Any) -> None:
        self.ex = executor

    # ---- setup ---------------------------------------------------------------------------------
    def describe(self) -> dict:
        """What the driver needs to choose paths: node, GPU uuid and index, the device list this
        process sees, the devices it can access, its arena's IPC handle, NCCL and P2P support."""
        from torch.multiprocessing.reductions import reduce_tensor

        dev = self.ex.arena.device
        ipc = None
        with contextlib.suppress(Exception):  # e.g. expandable segments: no IPC for this arena
            ipc = reduce_tensor(self.ex.arena)  # (rebuild function, args): picklable
        n = torch.cuda.device_count()
        index = dev.index if dev.index is not None else torch.cuda.current_device()
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
            "p2p": ipc is not None and cupy_runtime() is not None,
            "nccl": nccl_available(),
        }

    def nccl_id(self) -> Any:
        """A unique id for the communicator (asked of one member only: it starts NCCL's bootstrap)."""
        return nccl_module().get_unique_id()

    def connect(
        self, infos: Sequence[dict], paths: dict[tuple[int, int], str], nccl_uid: Any = None
    ) -> dict[int, str]:
        """Opens the IPC handles of this worker's pairs and its NCCL channel (its communicator's
        creation blocks until every member joins, so the driver calls every worker's `connect`
        at once). Returns {peer: path opened}."""
        me = self.gpu
        for (i, j), path in sorted(paths.items()):
            if me not in (i, j):
                continue
            peer = j if me == i else i
            if path in ("ipc", "p2p") and infos[peer]["pid"] == os.getpid():
                path = "ray"  # a process cannot open its own IPC handle (the local engine never gets here)
            if path == "ipc":
                rebuild, args = infos[peer]["ipc"]
                with torch.cuda.device(self.ex.arena.device):
                    self.peers[peer] = rebuild(*args)
            elif path == "p2p":
                self.p2p[peer] = _open_peer(infos[peer]["ipc"], self.ex.arena.device)
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


def _open_peer(ipc: Any, device: torch.device) -> tuple[int, int]:
    """Maps a peer's arena (torch's IPC export of it) into `device`: (base pointer, offset of the
    arena in the mapped allocation). Peer access is enabled as needed (lazily) by CUDA."""
    _, args = ipc
    # torch's rebuild_cuda_tensor arguments: 3 tensor offset (elements of uint8), 7 the
    # allocation's cudaIpcMemHandle, 9 the storage's byte offset in that allocation
    handle, offset = args[7], args[9] + args[3]
    rt = cupy_runtime()
    with torch.cuda.device(device):
        base = rt.ipcOpenMemHandle(handle, IPC_LAZY_PEER_ACCESS)
    return base, offset


def connect_workers(workers: Sequence[Any], key: str, allow: Sequence[str] = PATHS) -> dict[str, str]:
    """Driver side: chooses the path of every worker pair of graph `key` and has the workers open them.

    Returns {"i-j": path} for the run summary: what the workers opened. DISCO_CUDA_PATHS
    (comma-separated) narrows `allow`.
    """
    import ray

    if "DISCO_CUDA_PATHS" in os.environ:  # e.g. "ray": force the fallback (tests, debugging)
        allow = tuple(os.environ["DISCO_CUDA_PATHS"].split(","))
    infos = ray.get([w.transport_describe.remote(key) for w in workers])
    paths = choose_paths(infos, allow)
    members = nccl_members(paths)
    uid = ray.get(workers[members[0]].transport_nccl_id.remote(key)) if members else None
    opened = ray.get([w.transport_connect.remote(key, infos, paths, uid) for w in workers])
    out: dict[str, str] = {}
    for g, got in enumerate(opened):
        for peer, path in got.items():
            out[f"{min(g, peer)}-{max(g, peer)}"] = path
    return dict(sorted(out.items()))


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return socket.gethostname()
