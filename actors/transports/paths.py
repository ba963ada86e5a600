"""Which path each pair of cuda workers takes (`actors.transports.cuda`) and why a pair falls back
to Ray's object store (pure: the driver's calls that open the paths, `connect_workers`, are in
the Ray shell `actors.transports.cuda`).

Each worker reports itself (`CudaTransport.describe`): node, GPU, the device list it sees, its
arena's IPC exports, whether CuPy's runtime (p2p) and NCCL import, and, for each path it cannot
take, why (`"why"`: the import error, the failed IPC export). The choice is pure (`choose_paths`);
a pair left on "ray" gets its reason (`fallbacks`), which the driver logs as a warning naming the
pair and puts in the run summary (`placement.fallbacks`, printed under "transfer paths"): a
missing cupy or a failed export is never silent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from disco_ray.graph.errors import RunError

PATHS = ("ipc", "p2p", "nccl", "ray")


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


# ---- why a pair is left on Ray's object store (pure) ------------------------------------------------
def _lacks(path: str, *infos: dict) -> str:
    """What keeps `path` from those of the workers `infos` that cannot take it (their reasons)."""
    out = [
        f"gpu:{i.get('gpu', '?')} {i.get('why', {}).get(path) or 'does not support it'}"
        for i in infos
        if not i.get(path)
    ]
    return f"{path}: " + ", ".join(out) if out else ""


def fallback_reason(a: dict, b: dict, allow: Sequence[str] = PATHS) -> str:
    """Why `choose_path(a, b, allow)` is "ray": each faster path that fits the pair and what ruled
    it out (pure)."""
    same_node, same_gpu = a["node"] == b["node"], a["uuid"] == b["uuid"]
    why = []
    if same_gpu:
        wanted = ["ipc"] if same_node else []
    else:
        wanted = ["p2p", "nccl"] if same_node else ["nccl"]
    for path in wanted:
        if path not in allow:
            why.append(f"{path}: left out (DISCO_CUDA_PATHS)")
        elif path == "p2p":
            why.append(_lacks("p2p", a, b) or _no_peer_access(a, b))
        else:
            why.append(_lacks(path, a, b))
    if same_gpu:
        why.append("nccl: one GPU (NCCL takes one rank per GPU)")
    return "; ".join(w for w in why if w) or "no faster path fits this pair"


def _no_peer_access(a: dict, b: dict) -> str:
    if a.get("visible") != b.get("visible") or not a.get("visible"):
        return (
            f"p2p: the workers see different device lists "
            f"(CUDA_VISIBLE_DEVICES {a.get('visible')!r} and {b.get('visible')!r})"
        )
    one_way = a if b.get("device") not in a.get("peer_access", ()) else b
    other = b if one_way is a else a
    return f"p2p: gpu:{one_way.get('gpu', '?')}'s device cannot access gpu:{other.get('gpu', '?')}'s"


def fallbacks(
    infos: Sequence[dict], paths: dict[tuple[int, int], str], allow: Sequence[str] = PATHS
) -> dict[tuple[int, int], str]:
    """The reason of every pair of `paths` (from `choose_paths`) left on "ray" (pure)."""
    out = {}
    member_of: dict[str, int] = {}  # GPU uuid -> its NCCL rank's worker, as choose_paths made it
    for (i, j), path in sorted(paths.items()):
        if path == "nccl":
            for w in (i, j):
                member_of.setdefault(infos[w]["uuid"], w)
    for (i, j), path in sorted(paths.items()):
        if path != "ray":
            continue
        if choose_path(infos[i], infos[j], allow) == "nccl":  # the one-rank-per-GPU rule
            w = i if member_of.get(infos[i]["uuid"], i) != i else j
            out[(i, j)] = (
                f"nccl: gpu:{w} shares its GPU with gpu:{member_of[infos[w]['uuid']]}, that GPU's "
                "rank in the communicator (NCCL takes one rank per GPU)"
            )
        else:
            out[(i, j)] = fallback_reason(infos[i], infos[j], allow)
    return out


# ---- what the driver's connect returns ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Connected:
    """What `connect_workers` opened: {"i-j": path} and, for pairs on "ray", {"i-j": why}."""

    paths: dict[str, str]
    fallbacks: dict[str, str] = field(default_factory=dict)
