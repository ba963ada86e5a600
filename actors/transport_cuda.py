"""GPU-to-GPU transfers for the cuda backend: CUDA IPC, NCCL send/recv, or the Ray object store.

The path is chosen per worker pair once, at setup (`connect_workers`, called by the driver after
every worker has loaded its graph), from what each worker reports of itself (`describe_worker`):

- "ipc": both workers on one node and one physical GPU (fractional `num_gpus`: several workers
  share it, each with its own arena). Each worker exports a CUDA IPC handle of its arena (torch's
  `reduce_tensor`, i.e. cudaIpcGetMemHandle on the arena's allocation); a peer opens it once, and
  a transfer is one device-to-device cudaMemcpyAsync on the destination's stream from the peer's
  range into the local one (1.41 TB/s measured between two Ray actors on the H100).
- "nccl": different GPUs (or nodes), cupy's NCCL on both sides: one 2-rank communicator per pair
  (unique id made by the lower rank, handed over by the driver), so transfers of different pairs
  never queue behind each other. The destination asks the source (a Ray call) to enqueue
  `send` on its stream for that peer, then enqueues `recv` on its own stream; a per-pair lock
  keeps sends and receives in the same order on both ends. NCCL refuses two ranks on one GPU,
  so on the one-GPU test machine this path cannot run between two workers (see tests/test_gpu.py
  for what of it is exercised).
- "ray": the last fallback, `actors.transport.RayTransport` (bytes through the object store).

With the sanitizer on (`check=True`), every IPC/NCCL pull is followed, once its copy completed,
by the same range read through Ray: the source's sanitizer checks the read and the bytes must
equal what the fast path copied.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc

from .transport import RayTransport

PATHS = ("ipc", "nccl", "ray")


def nccl_available() -> bool:
    """True when cupy with NCCL can be imported here (imported lazily: the CPU build has no cupy)."""
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception:
        return False
    return True


def choose_path(a: dict, b: dict, allow: Sequence[str] = PATHS) -> str:
    """The transfer path between two workers described by `describe_worker` (pure)."""
    same_node = a["node"] == b["node"]
    if "ipc" in allow and same_node and a["uuid"] == b["uuid"] and a["ipc"] and b["ipc"]:
        return "ipc"
    if "nccl" in allow and a["uuid"] != b["uuid"] and a["nccl"] and b["nccl"]:
        return "nccl"
    return "ray"


def choose_paths(infos: Sequence[dict], allow: Sequence[str] = PATHS) -> dict[tuple[int, int], str]:
    """Path of every unordered pair (i < j) of workers."""
    n = len(infos)
    return {(i, j): choose_path(infos[i], infos[j], allow) for i in range(n) for j in range(i + 1, n)}


class CudaTransport:
    """The `Transport` of one cuda worker; `attach` gives it the executor, `connect` its peers."""

    def __init__(self, gpu: int, handles: Sequence[Any]):
        self.gpu = gpu
        self.handles = handles
        self.fallback = RayTransport(handles)
        self.ex: Any = None
        self.paths: dict[int, str] = {}
        self.peers: dict[int, torch.Tensor] = {}  # ipc: the peer's arena mapped into this process
        self.comms: dict[int, Any] = {}  # nccl: a 2-rank communicator per peer
        self.nccl_streams: dict[int, torch.cuda.Stream] = {}  # nccl: the send stream per peer
        self.locks: dict[int, threading.Lock] = {}
        self.pulls = dict.fromkeys(PATHS, 0)
        self.bytes = dict.fromkeys(PATHS, 0)

    def attach(self, executor: Any) -> None:
        self.ex = executor

    # ---- setup ---------------------------------------------------------------------------------
    def describe(self, nccl_ids_for: Sequence[int] = ()) -> dict:
        """What the driver needs to choose paths: node, GPU uuid, pid, IPC handle, NCCL ids."""
        from torch.multiprocessing.reductions import reduce_tensor

        dev = self.ex.arena.device
        ipc = None
        try:
            ipc = reduce_tensor(self.ex.arena)  # (rebuild function, args): picklable
        except Exception:
            ipc = None  # e.g. expandable segments: no IPC for this arena
        has_nccl = nccl_available()
        ids = {}
        if has_nccl:
            from cupy.cuda import nccl

            ids = {j: nccl.get_unique_id() for j in nccl_ids_for}
        return {
            "gpu": self.gpu,
            "node": _node_id(),
            "pid": os.getpid(),
            "uuid": str(torch.cuda.get_device_properties(dev).uuid),
            "ipc": ipc,
            "nccl": has_nccl,
            "nccl_ids": ids,
        }

    def connect(self, infos: Sequence[dict], paths: dict[tuple[int, int], str]) -> dict[int, str]:
        """Opens the IPC handles and NCCL communicators of this worker's pairs (NCCL init blocks
        until the peer joins, so the driver calls every worker's `connect` at once)."""
        me = self.gpu
        for (i, j), path in sorted(paths.items()):
            if me not in (i, j):
                continue
            peer = j if me == i else i
            self.locks[peer] = threading.Lock()
            if path == "ipc" and infos[peer]["pid"] == os.getpid():
                path = "ray"  # a process cannot open its own IPC handle (the local engine never gets here)
            if path == "ipc":
                rebuild, args = infos[peer]["ipc"]
                with torch.cuda.device(self.ex.arena.device):
                    self.peers[peer] = rebuild(*args)
            elif path == "nccl":
                from cupy.cuda import nccl

                uid = infos[i]["nccl_ids"][j]
                with torch.cuda.device(self.ex.arena.device):
                    self.comms[peer] = nccl.NcclCommunicator(2, uid, 0 if me == i else 1)
                    self.nccl_streams[peer] = torch.cuda.Stream(self.ex.arena.device)
            self.paths[peer] = path
        return dict(self.paths)

    # ---- a transfer ----------------------------------------------------------------------------
    def blocks(self, src_gpu: int) -> bool:
        """IPC enqueues one copy; NCCL asks the source for its send (a Ray call) and the Ray path
        waits for the bytes; the sanitizer's check of a pull waits for its copy."""
        checking = self.ex is not None and self.ex._check
        return checking or self.paths.get(src_gpu, "ray") != "ipc"

    def pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        path = self.paths.get(src_gpu, "ray")
        self.pulls[path] += 1
        self.bytes[path] += loc.nbytes
        if path == "ipc":
            dst.copy_(self.peers[src_gpu][loc.offset : loc.end], non_blocking=True)
        elif path == "nccl":
            with self.locks[src_gpu]:
                # the source enqueues its send before we enqueue the matching recv: same order
                # on both ends of the pair's communicator, whatever the interleaving of pulls
                import ray

                ray.get(self.handles[src_gpu].nccl_send.remote(self.gpu, loc))
                nccl_recv(self.comms[src_gpu], dst, self.rank_of(src_gpu))
        else:
            self.fallback.pull(src_gpu, loc, dst, reader, expect)
            return
        if self.ex is not None and self.ex._check:
            self._verify(src_gpu, loc, dst, reader, expect, path)

    def send(self, dst_gpu: int, loc: Loc) -> None:
        """Source side of an NCCL transfer: enqueue the send of `loc` to `dst_gpu` and return."""
        if self.paths.get(dst_gpu) != "nccl":
            raise RunError(
                f"gpu:{self.gpu}: gpu:{dst_gpu} asked for an NCCL send, but the pair uses "
                f"{self.paths.get(dst_gpu)!r}"
            )
        src = self.ex.arena[loc.offset : loc.end]
        nccl_send(self.comms[dst_gpu], src, self.rank_of(dst_gpu), self.nccl_streams[dst_gpu])

    def rank_of(self, peer: int) -> int:
        return 0 if peer < self.gpu else 1

    def _verify(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int, path: str) -> None:
        torch.cuda.current_stream().synchronize()
        ref = torch.empty(loc.nbytes, dtype=torch.uint8)
        self.fallback.pull(src_gpu, loc, ref, reader, expect)  # the source's sanitizer checks the read
        if not torch.equal(dst.cpu(), ref):
            raise RunError(
                f"gpu:{self.gpu}: transfer {reader} from gpu:{src_gpu} over {path} copied bytes that "
                f"differ from the source range [{loc.offset}, {loc.end})"
            )

    def statistics(self) -> dict:
        return {
            "paths": {str(k): v for k, v in sorted(self.paths.items())},
            "pulls": self.pulls,
            "bytes": self.bytes,
        }

    def close(self) -> None:
        self.peers.clear()
        for c in self.comms.values():
            with contextlib.suppress(Exception):  # a communicator whose peer died cannot be torn down
                c.destroy()
        self.comms.clear()


def nccl_send(comm: Any, src: torch.Tensor, peer: int, stream: torch.cuda.Stream) -> None:
    """ncclSend of the uint8 tensor `src` to `peer`, enqueued on `stream`."""
    from cupy.cuda import nccl

    comm.send(src.data_ptr(), src.numel(), nccl.NCCL_UINT8, peer, stream.cuda_stream)


def nccl_recv(comm: Any, dst: torch.Tensor, peer: int, stream: torch.cuda.Stream | None = None) -> None:
    """ncclRecv into the uint8 tensor `dst` from `peer`, enqueued on `stream` (default: current)."""
    from cupy.cuda import nccl

    st = stream if stream is not None else torch.cuda.current_stream()
    comm.recv(dst.data_ptr(), dst.numel(), nccl.NCCL_UINT8, peer, st.cuda_stream)


def connect_workers(workers: Sequence[Any], key: str, allow: Sequence[str] = PATHS) -> dict[str, str]:
    """Driver side: chooses the path of every worker pair of graph `key` and has the workers open them.

    Returns {"i-j": path} for the run summary. DISCO_CUDA_PATHS (comma-separated) narrows `allow`.
    """
    import ray

    if "DISCO_CUDA_PATHS" in os.environ:  # e.g. "ray": force the fallback (tests, debugging)
        allow = tuple(os.environ["DISCO_CUDA_PATHS"].split(","))
    n = len(workers)
    infos = ray.get([w.transport_describe.remote(key, list(range(g + 1, n))) for g, w in enumerate(workers)])
    paths = choose_paths(infos, allow)
    opened = ray.get([w.transport_connect.remote(key, infos, paths) for w in workers])
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
