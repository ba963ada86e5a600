"""Execution modes for the ablations: pure MemGraph transforms that only add edges.

- `dynamic`: the MemGraph as planned; the runtime is free to run any ready vertex (TURNIP §8).
- `deterministic`: each GPU's operations of one lane run in the planner's order, as in the papers'
  "(semi-)deterministic" ablation (TURNIP §8 (3), Figure 14); kernels may still overlap copies.
- `levelwise`: bulk-synchronous, level by level (DISCO Figure 2): a level's loads (inputs, reloads)
  run, then its kernels, transfers and offloads, and the next level waits for all of it.
- `in_memory`: planned with unlimited capacity, so nothing is offloaded (the lower bound).

Adding edges keeps a correct MemGraph correct (fewer orders are allowed); each transform checks
that the result stays acyclic by construction and keeps ids in a topological order.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from disco_ray.graph.errors import UsageError
from disco_ray.graph.memgraph import MemGraph, MemVertex, MKind, Read
from disco_ray.graph.taskgraph import TaskGraph

from .profiles import lane

MODES = ("dynamic", "deterministic", "levelwise", "in_memory")
_LOADS = (MKind.INPUT, MKind.RELOAD)


def dynamic(mg: MemGraph) -> MemGraph:
    """The MemGraph unchanged."""
    return mg


def deterministic(mg: MemGraph, per: str = "lane") -> MemGraph:
    """Chains the vertices of each GPU (per="gpu") or of each GPU lane (per="lane") in id order."""
    if per not in ("lane", "gpu"):
        raise UsageError(f"deterministic: per must be 'lane' or 'gpu', got {per!r}")
    have = {(u, w) for u, w, _ in mg.edges}
    last: dict[tuple, int] = {}
    new = []
    for v in sorted(mg.vertices, key=lambda v: v.id):
        key = (v.gpu, lane(v)) if per == "lane" else (v.gpu,)
        if key in last and (last[key], v.id) not in have:
            new.append((last[key], v.id, "mem"))
        last[key] = v.id
    return _with_edges(mg, new, {"mode": f"deterministic/{per}", "order_edges": len(new)})


def levelwise(mg: MemGraph, tg: TaskGraph, levels: Sequence[Sequence[str]] | Mapping[str, int]) -> MemGraph:
    """Adds barrier edges so each level's loads, then its other vertices, run before the next level.

    Args:
        mg: a MemGraph whose vertex list is in a topological order.
        tg: the TaskGraph it was planned from (ids in `levels` must be its vertices).
        levels: per level the TaskGraph ids in it, or a mapping id -> level. A vertex not named
            (an offload, a reload, an unlisted id) joins the level of the next named vertex in
            the planner's order, as the planner puts offloads and reloads just before their use.
    """
    level = (
        dict(levels) if isinstance(levels, Mapping) else {x: n for n, ids in enumerate(levels) for x in ids}
    )
    unknown = [x for x in level if x not in tg]
    if unknown:
        raise UsageError(f"levelwise: level ids {unknown[:3]} are not TaskGraph vertices")
    vs = mg.vertices
    named = [level.get(v.value) if v.kind not in (MKind.OFFLOAD, MKind.RELOAD) else None for v in vs]
    lv = [0] * len(vs)
    nxt = max(level.values(), default=0)
    for p in range(len(vs) - 1, -1, -1):
        n = named[p]
        if n is not None:
            nxt = n
        lv[p] = nxt
    phase = [2 * lv[p] + (0 if vs[p].kind in _LOADS else 1) for p in range(len(vs))]
    preds = mg.preds()
    # a vertex waiting on a later phase joins it (e.g. a load that reuses memory of a kernel of its level)
    moved = 0
    for p in range(len(vs)):
        hi = max((phase[u] for u in preds[p]), default=phase[p])
        if hi > phase[p]:
            phase[p] = hi
            moved += 1
    succs = mg.succs()
    groups: dict[int, list[int]] = {}
    for p in range(len(vs)):
        groups.setdefault(phase[p], []).append(p)
    new = []
    order = sorted(groups)
    for a, b in itertools.pairwise(order):
        sinks = [p for p in groups[a] if not any(phase[w] == a for w in succs[p])]
        sources = [p for p in groups[b] if not any(phase[u] == b for u in preds[p])]
        new += [(vs[u].id, vs[w].id, "mem") for u in sinks for w in sources]
    out = _with_edges(mg, new, {"mode": "levelwise", "barrier_edges": len(new), "phase_moved": moved})
    # (phase, position) is a topological order of old and new edges alike
    return _renumber(out, sorted(range(len(vs)), key=lambda p: (phase[p], p)))


def in_memory(tg: TaskGraph, alignment: int = 256, order=None) -> MemGraph:
    """Plans `tg` with room for every tensor at once, so the plan has no offloads or reloads."""
    from planner import build_memgraph

    need = [0] * tg.gpus
    for v in tg:
        need[v.gpu] += -(-v.nbytes // alignment) * alignment
    mg = build_memgraph(tg, [n + alignment for n in need], order=order, alignment=alignment)
    mg.stats["mode"] = "in_memory"
    return mg


def plan(
    tg: TaskGraph,
    mode: str,
    capacity,
    levels=None,
    alignment: int = 256,
    order=None,
    host_capacity=None,
) -> MemGraph:
    """Plans `tg` with the planner (serial `order`, default the planner's) for `capacity` (None:
    room for everything; `host_capacity`: the host stores' budget, beyond which offloads go to
    disk) and applies `mode` (one of MODES)."""
    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
    if mode == "in_memory":
        return in_memory(tg, alignment, order)
    from planner import build_memgraph, roomy_capacity

    if capacity is None:  # everything fits
        capacity = roomy_capacity(tg, alignment)
    mg = build_memgraph(tg, capacity, order=order, alignment=alignment, host_capacity=host_capacity)
    if mode == "deterministic":
        mg = deterministic(mg)
    elif mode == "levelwise":
        if levels is None:
            raise UsageError("mode levelwise needs the workload's levels")
        mg = levelwise(mg, tg, levels)
    mg._planned_for = id(tg)  # the planner's plan plus edges: a Program need not verify it again
    return mg


def _with_edges(mg: MemGraph, new: list[tuple[int, int, str]], stats: dict) -> MemGraph:
    return MemGraph(
        list(mg.capacity),
        list(mg.vertices),
        [*mg.edges, *new],
        dict(mg.outputs),
        list(mg.host_capacity),
        {**mg.stats, **stats},
        list(mg.disk_capacity),
    )


def _renumber(mg: MemGraph, order: list[int]) -> MemGraph:
    """The same graph with vertices listed in `order` (positions) and ids renamed 0..n-1 if they were."""
    if order == list(range(len(mg))):
        return mg
    vs = mg.vertices
    dense = all(v.id == p for p, v in enumerate(vs))
    new_id = {vs[p].id: (n if dense else vs[p].id) for n, p in enumerate(order)}
    # a sum-into group's readers name its member of highest id, which renumbering may change
    last: dict[str, int] = {}
    for v in vs:
        if v.acc is not None:
            last[v.value] = max(last.get(v.value, -1), new_id[v.id])
    named = {v.id: last[v.value] for v in vs if v.acc is not None}

    def rid(x: int | None) -> int | None:
        return None if x is None else named.get(x, new_id[x])

    verts = [
        MemVertex(
            new_id[vs[p].id],
            vs[p].kind,
            vs[p].value,
            vs[p].gpu,
            tuple(Read(r.value, rid(r.src), r.loc) for r in vs[p].ins),
            vs[p].out,
            vs[p].acc,
        )
        for p in order
    ]
    edges = [(new_id[u], new_id[w], k) for u, w, k in mg.edges]
    outputs = {k: named.get(v, new_id[v]) for k, v in mg.outputs.items()}
    return MemGraph(
        list(mg.capacity),
        verts,
        edges,
        outputs,
        list(mg.host_capacity),
        dict(mg.stats),
        list(mg.disk_capacity),
    )
