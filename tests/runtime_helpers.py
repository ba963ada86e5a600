"""Test helpers for the runtime: a small random TaskGraph generator and a trivial planner.

The trivial planner gives every value its own arena range (no reuse, so no memory edges); with
`offload_all` every produced value goes to the host store and back before its readers, and graph
inputs are re-read from the caller's copy (reload with src None), so every vertex kind runs.
It stands in for planner.build_memgraph until that lands; tests prefer the real planner.
"""

from __future__ import annotations

import random

from disco_ray.memgraph import HOST, INPUT, Loc, MemGraph, MemVertex, MKind, Read
from disco_ray.taskgraph import Kind, TaskGraph


def random_taskgraph(
    seed: int, n: int = 30, gpus: int = 2, dtype: str = "float32", size: int = 8
) -> TaskGraph:
    """A random DAG of inputs, elementwise ops, matmuls and transfers on `gpus` GPUs (square tiles)."""
    rng = random.Random(seed)
    g = TaskGraph(gpus=gpus)
    on: list[list[str]] = [[] for _ in range(gpus)]
    for gpu in range(gpus):
        for k in range(2):
            on[gpu].append(g.input(f"in{gpu}_{k}", (size, size), dtype, gpu=gpu))
    for i in range(n):
        gpu = rng.randrange(gpus)
        r = rng.random()
        if r < 0.15 and gpus > 1:
            src = rng.choice([x for x in range(gpus) if x != gpu])
            on[gpu].append(g.transfer(rng.choice(on[src][-6:]), gpu=gpu, id=f"t{i}"))
            continue
        pool = on[gpu][-6:]
        if r < 0.45:
            v = g.matmul(rng.choice(pool), rng.choice(pool), id=f"mm{i}")
            v = g.scale(v, 1.0 / size, id=f"s{i}")
        elif r < 0.7:
            v = g.add(*rng.sample(pool, min(len(pool), rng.randint(1, 3))), id=f"a{i}")
        elif r < 0.85:
            v = g.silu(rng.choice(pool), id=f"u{i}")
        else:
            v = g.rmsnorm(rng.choice(pool), id=f"r{i}")
        on[gpu].append(v)
    used = {x for v in g for x in v.inputs}
    outs = [v.id for v in g if v.id not in used and v.kind is not Kind.INPUT]
    g.output(*(outs or [list(g.vertices)[-1]]))
    return g


def trivial_memgraph(tg: TaskGraph, *, offload_all: bool = False, align: int = 256) -> MemGraph:
    """Every value gets its own range; `offload_all` adds an offload+reload pair for each read value."""
    top = [0] * tg.gpus
    host_top = [0] * tg.gpus
    verts: list[MemVertex] = []
    edges: list[tuple[int, int, str]] = []
    where: dict[str, tuple[int, Loc]] = {}  # value -> (vertex holding it, loc)
    readers = tg.consumers()

    def alloc(tops: list[int], gpu: int, nbytes: int, dev: int) -> Loc:
        loc = Loc(dev, tops[gpu], nbytes)
        tops[gpu] += -(-max(nbytes, 1) // align) * align
        return loc

    def add(kind: MKind, value: str, gpu: int, ins: list[Read], out: Loc) -> int:
        vid = len(verts)
        verts.append(MemVertex(vid, kind, value, gpu, tuple(ins), out))
        for r in ins:
            if r.src is not None and (r.src, vid, "data") not in edges:
                edges.append((r.src, vid, "data"))
        return vid

    for v in tg:
        nb = v.nbytes
        if v.kind is Kind.INPUT:
            vid = add(MKind.INPUT, v.id, v.gpu, [], alloc(top, v.gpu, nb, v.gpu))
        else:
            ins = [Read(x, where[x][0], where[x][1]) for x in v.inputs]
            kind = MKind.KERNEL if v.kind is Kind.KERNEL else MKind.TRANSFER
            vid = add(kind, v.id, v.gpu, ins, alloc(top, v.gpu, nb, v.gpu))
        where[v.id] = (vid, verts[vid].out)
        if offload_all and readers[v.id]:
            if v.kind is Kind.INPUT:
                rl = add(
                    MKind.RELOAD,
                    v.id,
                    v.gpu,
                    [Read(v.id, None, Loc(INPUT, 0, nb))],
                    alloc(top, v.gpu, nb, v.gpu),
                )
                edges.append((vid, rl, "data"))  # keeps the input vertex in use
            else:
                off = add(
                    MKind.OFFLOAD,
                    v.id,
                    v.gpu,
                    [Read(v.id, vid, verts[vid].out)],
                    alloc(host_top, v.gpu, nb, HOST),
                )
                rl = add(
                    MKind.RELOAD, v.id, v.gpu, [Read(v.id, off, verts[off].out)], alloc(top, v.gpu, nb, v.gpu)
                )
            where[v.id] = (rl, verts[rl].out)
    outputs = {o: where[o][0] for o in tg.outputs}
    return MemGraph(list(top), verts, edges, outputs, list(host_top))


def planners() -> list[str]:
    """Plan modes the tests run: the trivial planner's two, plus the real planner's when it is there."""
    modes = ["trivial", "offload"]
    try:
        from planner import build_memgraph  # noqa: F401
    except ImportError:
        return modes
    return [*modes, "planner", "planner-tight"]


def plan(tg: TaskGraph, mode: str) -> MemGraph:
    """A MemGraph for `tg`: "trivial", "offload" (trivial_memgraph) or the real planner, roomy or tight."""
    if mode in ("trivial", "offload"):
        return trivial_memgraph(tg, offload_all=mode == "offload")
    from planner import build_memgraph

    if mode == "planner":
        return build_memgraph(tg, 1 << 24)
    return build_memgraph(tg, tight_capacity(tg))


def tight_capacity(tg: TaskGraph, align: int = 256) -> int:
    """Barely more than the largest vertex needs (its distinct inputs and output): many offloads."""
    need = 0
    for v in tg:
        ids = dict.fromkeys([*v.inputs, v.id])
        need = max(need, sum(-(-tg[i].nbytes // align) * align for i in ids))
    return need + 2 * align
