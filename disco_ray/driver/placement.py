"""Where the actors run: one GpuWorker per GPU in a Ray placement group, the coordinator on the driver's node.

Each TaskGraph GPU g gets bundle g of one placement group ({"GPU": f, "CPU": c}) and its worker is
pinned to that bundle, so Ray (not a host list) finds the GPUs, on one node or many; `pack` keeps
the bundles on as few nodes as fit (PlacementGroup strategy PACK), `spread` puts them on as many as
it can (SPREAD). The coordinator is pinned (NodeAffinity, soft=False) to the driver's node: it talks
to every worker, and the driver watches it.

The transfer path between two workers follows from where they landed and the backend:
same-process (local engine), object-store (cpu backend: the destination pulls through Ray, within a
node or across nodes), cuda-ipc (cuda, same node: peer copy through CUDA IPC handles; cuda-p2p when
the two workers are on two GPUs with peer access), nccl (cuda, different nodes). Pure functions
below decide the expected path; the run summary shows what the transports actually opened.
`place` is the thin Ray shell.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from disco_ray.graph.errors import RunError, UsageError

STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}
PATHS = ("same-process", "object-store", "cuda-ipc", "cuda-p2p", "nccl")
READY_TIMEOUT_S = 120.0  # a placement group that cannot be satisfied fails the run instead of hanging
NO_GPU_CPU = 0.001  # a bundle must ask for something: on a cluster without GPUs (cpu backend) a sliver of CPU


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How workers are placed.

    Attributes:
        strategy: "pack" (fewest nodes) or "spread" (most nodes).
        gpus_per_worker: GPU share of each worker; None: 1 when the cluster has a GPU per worker,
            else an equal share of what it has (0 on a cluster without GPUs, cpu backend only).
        cpus_per_worker: CPUs reserved per worker (0: the worker's threads are not accounted).
        ready_timeout_s: how long to wait for the cluster to grant the placement group.
    """

    strategy: str = "pack"
    gpus_per_worker: float | None = None
    cpus_per_worker: float = 0.0
    ready_timeout_s: float = READY_TIMEOUT_S

    def validate(self) -> None:
        if self.strategy not in STRATEGIES:
            raise UsageError(f"unknown placement {self.strategy!r} (one of {', '.join(STRATEGIES)})")
        g, c = self.gpus_per_worker, self.cpus_per_worker
        if g is not None and not (math.isfinite(g) and g > 0):
            raise UsageError(f"gpus_per_worker must be > 0 (--gpus-per-worker), got {g}")
        if not (math.isfinite(c) and c >= 0):
            raise UsageError(f"cpus_per_worker must be >= 0 (--cpus-per-worker), got {c}")
        if not (math.isfinite(self.ready_timeout_s) and self.ready_timeout_s > 0):
            raise UsageError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")


def gpu_share(have: float, n: int, backend: str, requested: float | None = None) -> float:
    """GPUs each of `n` workers asks for, given `have` GPUs in the cluster."""
    if requested is not None:
        if requested * n > have + 1e-9:
            raise RunError(
                f"{n} workers x {requested} GPU need {requested * n:g} GPUs; the Ray cluster has {have:g}"
            )
        return requested
    if have <= 0:
        if backend != "cpu":
            raise RunError(f"the Ray cluster has no GPU for backend {backend!r}")
        return 0.0
    if have >= n:
        return 1.0
    # Ray accepts fractions with 4 decimals; round down so that n shares still fit
    return int(have / n * 1e4) / 1e4


def bundles(n: int, gpu: float, cpu: float = 0.0) -> list[dict[str, float]]:
    """One placement-group bundle per worker."""
    b: dict[str, float] = {}
    if gpu > 0:
        b["GPU"] = gpu
    if cpu > 0 or not b:
        b["CPU"] = cpu if cpu > 0 else NO_GPU_CPU
    return [dict(b) for _ in range(n)]


def infeasible(
    bs: Sequence[dict[str, float]], nodes: Sequence[dict[str, float]], strategy: str
) -> str | None:
    """Why the cluster's nodes (their total resources) can never hold the bundles, or None: a
    bundle no node is big enough for, or more of a resource than the whole cluster has. (A
    feasible group may still wait for resources in use; `place` bounds that wait.)"""
    need: dict[str, float] = {}
    for b in bs:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    have = {k: sum(nd.get(k, 0.0) for nd in nodes) for k in need}
    asked = f"{len(bs)} workers of {_fmt(bs[0])} ({strategy})" if bs else "no workers"
    for k, v in need.items():
        if v > have[k] + 1e-9:
            return f"the Ray cluster can never place {asked}: they need {v:g} {k}, it has {have[k]:g} in all"
    for b in bs:
        if not any(all(nd.get(k, 0.0) + 1e-9 >= v for k, v in b.items()) for nd in nodes):
            biggest = max(nodes, key=lambda nd: nd.get("CPU", 0.0), default={})
            return (
                f"the Ray cluster can never place {asked}: no node holds one worker's {_fmt(b)} "
                f"(the largest has {_fmt({k: biggest.get(k, 0.0) for k in b})})"
            )
    return None


def _fmt(b: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(b.items())) + "}"


def transfer_path(
    src_node: str | None, dst_node: str | None, backend: str, *, same_process: bool = False
) -> str:
    """The path a transfer from a worker on `src_node` to one on `dst_node` takes."""
    if same_process:
        return "same-process"
    if backend == "cpu":
        return "object-store"  # arenas are host memory: Ray moves the bytes, across nodes too
    return "cuda-ipc" if src_node == dst_node else "nccl"


def transfer_pairs(mg) -> list[tuple[int, int]]:
    """(source GPU, destination GPU) of every GPU-to-GPU transfer of a MemGraph, sorted, once each."""
    return sorted({(v.ins[0].loc.device, v.gpu) for v in mg.vertices if v.kind.value == "transfer"})


def transfer_paths(
    nodes: Sequence[str | None],
    backend: str,
    pairs: Sequence[tuple[int, int]] | None = None,
    *,
    local: bool = False,
) -> dict[str, str]:
    """{"SRC->DST": path} for `pairs` (default: every ordered pair) of workers on `nodes`."""
    if pairs is None:
        pairs = [(a, b) for a in range(len(nodes)) for b in range(len(nodes)) if a != b]
    return {f"{a}->{b}": transfer_path(nodes[a], nodes[b], backend, same_process=local) for a, b in pairs}


# the names the transports give their paths (engine.transports, "i-j" -> name) -> the names used here
OPENED = {
    "ray": "object-store",
    "ipc": "cuda-ipc",
    "p2p": "cuda-p2p",
    "nccl": "nccl",
    "local": "same-process",
}


def describe(
    info: dict,
    mg,
    backend: str,
    opened: dict[str, str] | None = None,
    fallbacks: dict[str, str] | None = None,
) -> dict:
    """The run summary's "placement" entry: `info` (from `place`) plus the transfer path of each used pair.

    `opened` ({"i-j": "ray"|"ipc"|"nccl"}, i < j): what the transports actually opened (a cuda
    worker falls back to the object store where CUDA IPC or NCCL cannot run); it overrides the
    choice by node ids. `fallbacks` ({"i-j": why}): why such a pair is on the object store.
    """
    nodes = [w["node_id"] for w in info["workers"]]
    paths = transfer_paths(nodes, backend, [p for p in transfer_pairs(mg) if max(p) < len(nodes)])
    if opened:
        for key in paths:
            a, b = sorted(int(x) for x in key.split("->"))
            got = opened.get(f"{a}-{b}")
            if got is not None:
                paths[key] = OPENED.get(got, got)
    counts: dict[str, int] = {}
    for p in paths.values():
        counts[p] = counts.get(p, 0) + 1
    return {
        **info,
        "workers": info["workers"][: mg.gpus],
        "nodes": len({w["node_id"] for w in info["workers"][: mg.gpus]}),
        "paths": paths,
        "path_counts": counts,
        **({"fallbacks": dict(fallbacks)} if fallbacks else {}),
    }


def connect(
    workers: Sequence, key: str, mg, backend: str, placed: dict | None
) -> tuple[dict, dict, dict | None]:
    """Each worker pair's transfer path ({"i-j": path}; cuda: CUDA IPC, NCCL or the object store),
    why a pair is left on the object store ({"i-j": why}), and the run summary's "placement"
    entry (`describe`; None without `placed`, the pool's placement info)."""
    n = len(workers)
    paths, fallbacks = {f"{i}-{j}": "ray" for i in range(n) for j in range(i + 1, n)}, {}
    if backend == "cuda" and n > 1:
        from actors.transports.cuda import connect_workers

        got = connect_workers(workers, key)
        paths, fallbacks = got.paths, got.fallbacks
    summary = None if placed is None else describe(placed, mg, backend, paths, fallbacks)
    return paths, fallbacks, summary


# ---- the Ray shell ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Placed:
    """What `place` made: the placement group, the actors, and where they are."""

    pg: Any
    coord: Any
    workers: list
    info: dict


def place(
    n: int, backend: str, cfg: PlacementConfig, worker_cls, coord_cls, worker_args=(), **actor_opts
) -> Placed:
    """Reserves a placement group of `n` bundles and starts the coordinator and one worker per bundle.

    Raises:
        RunError: the cluster cannot hold the bundles within `cfg.ready_timeout_s` (names them).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    cfg.validate()
    share = gpu_share(ray.cluster_resources().get("GPU", 0), n, backend, cfg.gpus_per_worker)
    bs = bundles(n, share, cfg.cpus_per_worker)
    nodes = [dict(nd["Resources"]) for nd in ray.nodes() if nd.get("Alive")]
    bad = infeasible(bs, nodes, cfg.strategy)
    if bad:
        raise RunError(bad)
    pg = placement_group(bs, strategy=STRATEGIES[cfg.strategy])
    ready, _ = ray.wait([pg.ready()], timeout=cfg.ready_timeout_s)
    if not ready:
        remove_placement_group(pg)
        free = {k: round(v, 3) for k, v in ray.available_resources().items() if k in bs[0]}
        raise RunError(
            f"the Ray cluster could not place {n} workers of {_fmt(bs[0])} ({cfg.strategy}) within "
            f"{cfg.ready_timeout_s:g} s; free now: {_fmt(free)} (others hold the rest)"
        )
    driver_node = ray.get_runtime_context().get_node_id()
    coord = (
        ray.remote(coord_cls)
        .options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(driver_node, soft=False),
            **actor_opts,
        )
        .remote()
    )
    res = {k: v for k, v in bs[0].items() if k != "GPU"}
    cls = ray.remote(worker_cls)
    workers = [
        cls.options(
            num_cpus=res.get("CPU", 0),
            num_gpus=share,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=g, placement_group_capture_child_tasks=False
            ),
            **actor_opts,
        ).remote(*worker_args)
        for g in range(n)
    ]
    return Placed(pg, coord, workers, _where(pg, n, cfg, share, driver_node))


def _where(pg, n: int, cfg: PlacementConfig, share: float, driver_node: str) -> dict:
    """Node id and IP of each bundle (so of each worker) and of the coordinator."""
    import ray
    from ray.util.placement_group import placement_group_table

    by_bundle = placement_group_table(pg)["bundles_to_node_id"]
    ips = {nd["NodeID"]: nd["NodeManagerAddress"] for nd in ray.nodes()}
    return {
        "strategy": cfg.strategy,
        "gpus_per_worker": share,
        "coordinator": {"node_id": driver_node, "ip": ips.get(driver_node)},
        "workers": [
            {"gpu": g, "node_id": by_bundle[g], "ip": ips.get(by_bundle[g]), "bundle": g} for g in range(n)
        ],
    }


def remove(placed: Placed | None) -> None:
    """Releases the placement group (its actors must be killed first)."""
    if placed is None:
        return
    from ray.util.placement_group import remove_placement_group

    with contextlib.suppress(Exception):  # Ray already gone or the group removed: nothing to release
        remove_placement_group(placed.pg)


# ---- command line ---------------------------------------------------------------------------------
def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """--address, --placement, --gpus-per-worker, --cpus-per-worker (for `disco-ray run` and bench)."""
    p.add_argument(
        "--address",
        metavar="auto|ADDR",
        help="connect to a running Ray cluster (auto: the one on this machine or $RAY_ADDRESS; "
        "HOST:PORT: its GCS) instead of starting a local one",
    )
    p.add_argument(
        "--placement", choices=sorted(STRATEGIES), default="pack", help="place workers on few or many nodes"
    )
    p.add_argument(
        "--gpus-per-worker",
        type=float,
        metavar="F",
        help="GPU share per worker (default: 1, or an equal share)",
    )
    p.add_argument("--cpus-per-worker", type=float, default=0.0, metavar="C", help="CPUs reserved per worker")


def cluster_kwargs(args: argparse.Namespace) -> dict:
    """Program keyword arguments from the options of `add_cluster_args`."""
    timeout = getattr(args, "timeout", None)  # --timeout bounds the wait for a placement too
    cfg = PlacementConfig(
        strategy=getattr(args, "placement", "pack"),
        gpus_per_worker=getattr(args, "gpus_per_worker", None),
        cpus_per_worker=getattr(args, "cpus_per_worker", 0.0) or 0.0,
        ready_timeout_s=min(READY_TIMEOUT_S, timeout) if timeout else READY_TIMEOUT_S,
    )
    cfg.validate()
    return {"placement": cfg, "address": getattr(args, "address", None)}
