"""Running on an existing Ray cluster: connecting to it, and measuring its transfer links.

    connect("auto")                     # the cluster of this machine, or $RAY_ADDRESS (inside `ray job`)
    connect("10.0.0.1:6379")            # a GCS address
    figures = measure_links(prog)       # after a run: GB/s of each worker pair's transfer path

`measure_links` moves `nbytes` from every worker to every other one through the path the runtime
chose for that pair (disco_ray/driver/placement.py: object-store on the cpu backend; a cuda build's
transport is used when it offers `probe`), timed in the receiving worker, and a host memcpy on each
node, and returns a JSON-ready dict for the bench command.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from disco_ray.graph.errors import RunError

from .placement import transfer_path

PROBE_BYTES = 4 << 20
CONNECT_TIMEOUT_S = 5.0  # a GCS that does not accept a TCP connection in this long is not there
PROBE_REPEATS = 3


def running_cluster() -> str | None:
    """The address of a running Ray cluster to reuse instead of starting a private one, or None.

    `$DISCO_RAY_ADDRESS` decides when set ("local": never reuse; else that address); then
    `$RAY_ADDRESS` (set inside `ray job submit`, or by the user); then the cluster `ray start`
    recorded on this machine (Ray's own address file), if its GCS port answers. Starting a private
    Ray costs seconds (docs/RUNTIME.md, "Start-up"); a cluster left running with `ray start --head` saves them.
    """
    import socket

    own = os.environ.get("DISCO_RAY_ADDRESS")
    if own:
        return None if own == "local" else own
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    try:
        from ray._private.utils import read_ray_address

        addr = read_ray_address()
    except Exception:  # Ray's private helper moved or failed: start a private Ray
        return None
    if not addr:
        return None
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return addr
    except (OSError, ValueError):
        return None  # a stale record: that cluster is gone


def connect(address: str, **kw: Any) -> None:
    """Connects this driver to a running Ray cluster ("auto", "HOST:PORT" or "ray://HOST:PORT").

    Raises:
        RunError: no cluster answers at `address`.
    """
    import ray

    if ray.is_initialized():
        return
    probe(address)
    try:
        # ray.init takes a level name too (setup_logger converts it); its annotation says int
        ray.init(address=address, logging_level="WARNING", **kw)  # type: ignore[arg-type]
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RunError(f"cannot connect to the Ray cluster at {address!r}: {e}") from None


def probe(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """RunError at once when nothing listens at `address` (ray.init would retry for a minute or
    more): "HOST:PORT" and "ray://HOST:PORT" are tried with one TCP connection; "auto" is
    resolved as Ray does ($RAY_ADDRESS, then the address file `ray start` wrote) first."""
    import socket

    shown = address
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or ""
        if not address:
            try:
                from ray._private.utils import read_ray_address

                address = read_ray_address() or ""
            except Exception:  # Ray's private helper moved: leave it to ray.init
                return
        if not address:
            raise RunError(
                "--address auto: no Ray cluster runs on this machine (start one: ray start --head)"
            )
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # not HOST:PORT (a name Ray resolves itself): leave it to ray.init
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise RunError(
            f"cannot connect to the Ray cluster at {shown!r}: nothing answers at {host}:{port} within "
            f"{timeout:g} s ({why})"
        ) from None


def nodes() -> list[dict]:
    """Alive nodes of the connected cluster: id, IP, resources."""
    import ray

    return [
        {"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "resources": dict(n["Resources"])}
        for n in ray.nodes()
        if n["Alive"]
    ]


# ---- functions run inside the GpuWorker actors (GpuWorker.call) ------------------------------------
def _source(worker, nbytes: int):
    """The probe buffer of this worker (made once): what a peer pulls."""
    import numpy as np

    buf = getattr(worker, "_probe_buf", None)
    if buf is None or buf.nbytes != nbytes:
        buf = np.full(nbytes, 7, dtype=np.uint8)
        worker._probe_buf = buf
    return buf


def _pull(worker, src_gpu: int, src_handle, nbytes: int, repeats: int) -> dict:
    """Pulls the probe buffer of `src_handle` `repeats` times (after one warm-up); seconds per pull."""
    import numpy as np
    import ray

    transport = getattr(worker, "transport", None)
    probe = getattr(transport, "probe", None)  # a cuda transport times its own one-sided copy
    if probe is not None and not probe(src_gpu, nbytes):
        probe = None  # the pair's path has none (NCCL needs both ends): time the object store
    dst = np.empty(nbytes, dtype=np.uint8)
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        if probe is not None:
            probe(src_gpu, nbytes)
        else:
            dst[...] = ray.get(src_handle.call.remote(_source, nbytes))  # as RayTransport.pull does
        if i:
            times.append(time.perf_counter() - t)
    if probe is None and int(dst[-1]) != 7:
        raise RunError(f"link probe from gpu:{src_gpu}: wrong bytes arrived")
    return {"seconds": times, "via": "transport" if probe is not None else "object-store"}


def _memcpy(worker, nbytes: int, repeats: int) -> list[float]:
    """Seconds per host copy of `nbytes` in this worker's process."""
    import numpy as np

    a, b = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        b[...] = a
        times.append(time.perf_counter() - t)
    return times[1:]


# ---- driver side -----------------------------------------------------------------------------------
def _gbps(nbytes: int, seconds: Sequence[float]) -> float:
    return round(nbytes / max(statistics.median(seconds), 1e-9) / 1e9, 4)


def measure_links(
    target: Any,
    placement: dict | None = None,
    *,
    backend: str = "cpu",
    nbytes: int = PROBE_BYTES,
    repeats: int = PROBE_REPEATS,
    pairs: Sequence[tuple[int, int]] | None = None,
) -> dict:
    """Bandwidth of each worker pair's transfer path, and a host memcpy per node.

    Args:
        target: a `runtime.Program` (after a run on the ray engine), a `RayEngine`, or a list of
            GpuWorker handles (then `placement` is required).
        placement: the run summary's "placement" entry (node of each worker); taken from target
            when it is a Program or engine.
        backend: the run's backend (decides the path of each pair).
        nbytes: bytes per probe transfer.
        repeats: timed transfers per pair (after one warm-up); the median counts.
        pairs: (src, dst) GPU pairs to measure (default: every ordered pair).

    Returns:
        {"probe_bytes", "repeats", "links": [{"src", "dst", "path", "via", "src_node", "dst_node",
        "gbps"}], "paths": {path: {"links", "gbps_median", "gbps_min", "gbps_max"}},
        "nodes": [{"node_id", "ip", "gpus", "memcpy_gbps", "resources"}]}.

    Raises:
        RunError: a worker is not reachable (named), or target has no live workers.
    """
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    workers, placement, backend = _unpack(target, placement, backend)
    n = len(workers)
    node_of = [w["node_id"] for w in placement["workers"][:n]]
    if pairs is None:
        pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
    opened = placement.get("paths", {})  # what the transports opened, "a->b" -> path
    links = []
    for a, b in pairs:
        path = opened.get(f"{a}->{b}") or transfer_path(node_of[a], node_of[b], backend)
        try:
            r = ray.get(workers[b].call.remote(_pull, a, workers[a], nbytes, repeats))
        except (RayActorError, RayTaskError) as e:
            raise RunError(f"link probe gpu:{a} -> gpu:{b} failed: {type(e).__name__}: {e}") from None
        links.append(
            {
                "src": a,
                "dst": b,
                "path": path,
                "via": path if r["via"] == "transport" else r["via"],
                "src_node": node_of[a],
                "dst_node": node_of[b],
                "gbps": _gbps(nbytes, r["seconds"]),
            }
        )
    by_path: dict[str, list[float]] = {}
    for ln in links:
        by_path.setdefault(ln["path"], []).append(ln["gbps"])
    info = {x["node_id"]: x for x in nodes()}
    per_node = []
    for node in dict.fromkeys(node_of):
        first = node_of.index(node)
        secs = ray.get(workers[first].call.remote(_memcpy, nbytes, repeats))
        per_node.append(
            {
                "node_id": node,
                "ip": info.get(node, {}).get("ip"),
                "gpus": [g for g in range(n) if node_of[g] == node],
                "memcpy_gbps": _gbps(nbytes, secs),
                "resources": info.get(node, {}).get("resources", {}),
            }
        )
    return {
        "probe_bytes": nbytes,
        "repeats": repeats,
        "backend": backend,
        "links": links,
        "paths": {
            p: {
                "links": len(v),
                "gbps_median": round(statistics.median(v), 4),
                "gbps_min": min(v),
                "gbps_max": max(v),
            }
            for p, v in sorted(by_path.items())
        },
        "nodes": per_node,
    }


def _unpack(target: Any, placement: dict | None, backend: str) -> tuple[list, dict, str]:
    """(worker handles, placement, backend) from a Program, a RayEngine or a list of handles."""
    eng = getattr(target, "_engine", None) or target  # a Program holds its engine once it ran
    if isinstance(eng, (list, tuple)):
        if placement is None:
            raise RunError(
                "measure_links: pass the placement (summary['placement']) with bare worker handles"
            )
        return list(eng), placement, backend
    workers = getattr(eng, "workers", None)
    if not workers:
        raise RunError("measure_links: no live workers (run the Program on the ray engine first)")
    placement = placement or getattr(eng, "placement_summary", None)
    if placement is None:
        raise RunError("measure_links: the engine has no placement information")
    return list(workers), placement, getattr(target, "backend", backend)
