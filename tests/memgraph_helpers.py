"""Hand-made MemGraphs for tests that must not depend on the planner."""

from __future__ import annotations

from disco_ray.graph.memgraph import Loc, MemGraph, MemVertex, MKind, Read
from disco_ray.graph.taskgraph import Kind, TaskGraph


def replaced(mg: MemGraph, **kw) -> MemGraph:
    """A copy of `mg` (its own lists; not marked as this process's plan) with MemGraph fields replaced."""
    f = {
        "capacity": list(mg.capacity),
        "vertices": list(mg.vertices),
        "edges": list(mg.edges),
        "outputs": dict(mg.outputs),
        "host_capacity": list(mg.host_capacity),
        "stats": dict(mg.stats),
        "disk_capacity": list(mg.disk_capacity),
    }
    f.update(kw)
    return MemGraph(**f)


def naive_memgraph(tg: TaskGraph, extra_edges=()) -> MemGraph:
    """Every TaskGraph vertex gets its own byte range (nothing reused, nothing offloaded); an
    `accumulate` becomes one sum-into kernel per operand (any order, one at a time)."""
    pos: dict[str, int] = {}
    members: dict[str, list[int]] = {}  # accumulate -> its sum-into kernels
    off = [0] * tg.gpus
    verts, edges = [], []

    def deps(x: str) -> list[int]:
        return members.get(x, [pos[x]])

    for v in tg:
        i = len(verts)
        kind = {Kind.INPUT: MKind.INPUT, Kind.KERNEL: MKind.KERNEL, Kind.TRANSFER: MKind.TRANSFER}[v.kind]
        out = Loc(v.gpu, off[v.gpu], v.nbytes)
        off[v.gpu] += v.nbytes
        if v.op == "accumulate":
            for k, x in enumerate(v.inputs):
                j = len(verts)
                verts.append(
                    MemVertex(
                        j, kind, v.id, v.gpu, (Read(x, pos[x], verts[pos[x]].out),), out, (k, len(v.inputs))
                    )
                )
                edges += [(d, j, "data") for d in deps(x)]
                members.setdefault(v.id, []).append(j)
            pos[v.id] = members[v.id][-1]
            continue
        ins = tuple(Read(x, pos[x], verts[pos[x]].out) for x in v.inputs)
        verts.append(MemVertex(i, kind, v.id, v.gpu, ins, out))
        edges += [(d, i, "data") for x in dict.fromkeys(v.inputs) for d in deps(x)]
        pos[v.id] = i
    edges += [(pos[a], pos[b], "mem") for a, b in extra_edges]
    return MemGraph(list(off), verts, edges, {o: pos[o] for o in tg.outputs})


def execute_random_order(mg: MemGraph, tg: TaskGraph, inputs, seed: int = 0) -> dict:
    """Runs `mg` on CPU byte arenas in a random order the edges allow; returns the outputs.

    A wrong plan (a missing memory edge) shows up as wrong outputs for some seeds.
    """
    import random

    import torch

    from disco_ray.graph.dtypes import torch_dtype
    from disco_ray.graph.memgraph import DISK, HOST, INPUT

    rng = random.Random(seed)
    gpu_arena = [torch.zeros(max(c, 1), dtype=torch.uint8) for c in mg.capacity]
    tiers = {HOST: [0] * mg.gpus, DISK: [0] * mg.gpus}  # per GPU: its host store, its spill file
    for v in mg.vertices:
        if v.out.device in tiers:
            size = tiers[v.out.device]
            size[v.gpu] = max(size[v.gpu], v.out.end)
    areas = {t: [torch.zeros(max(s, 1), dtype=torch.uint8) for s in sizes] for t, sizes in tiers.items()}

    def view(loc, gpu: int, value: str):
        tv = tg[value]
        if loc.device == INPUT:
            return inputs[value]
        arena = areas[loc.device][gpu] if loc.device in areas else gpu_arena[loc.device]
        return arena[loc.offset : loc.offset + tv.nbytes].view(torch_dtype(tv.dtype)).view(tv.shape)

    preds = mg.preds()
    succs = mg.succs()
    indeg = [len(p) for p in preds]
    ready = [p for p in range(len(mg)) if indeg[p] == 0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny kernels: thread hand-offs cost more than they save on a busy machine
    try:
        _run(mg, tg, inputs, rng, view, succs, indeg, ready)
    finally:
        torch.set_num_threads(threads)
    return {k: view(mg.vertex(vid).out, mg.vertex(vid).gpu, k).clone() for k, vid in mg.outputs.items()}


def _run(mg, tg, inputs, rng, view, succs, indeg, ready) -> None:
    from disco_ray.graph.kernels import run_kernel

    started: set[str] = set()  # sum-into groups whose first member ran (it writes, later ones add)
    while ready:
        p = ready.pop(rng.randrange(len(ready)))
        v = mg.vertices[p]
        out = view(v.out, v.gpu, v.value)
        if v.kind is MKind.INPUT:
            out.copy_(inputs[v.value])
        elif v.acc is not None:
            r = v.ins[0]
            x = view(r.loc, v.gpu, r.value)
            out.add_(x) if v.value in started else out.copy_(x)
            started.add(v.value)
        elif v.kind is MKind.KERNEL:
            tv = tg[v.value]
            ins = [view(r.loc, v.gpu, r.value) if r.src is not None else inputs[r.value] for r in v.ins]
            run_kernel(tv.op, out, [x.clone() for x in ins], tv.attrs)
        else:
            r = v.ins[0]
            out.copy_(inputs[r.value] if r.src is None else view(r.loc, v.gpu, r.value))
        for w in succs[p]:
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(w)
