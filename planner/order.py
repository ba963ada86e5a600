"""The serial order V that BUILDMEMGRAPH simulates (TURNIP section 6).

The order is the planner's most important input: memory edges point forward in it, so it bounds
what the runtime can overlap, and it decides which values are live together. The default is a
*schedule order*: the start order of a list schedule of the TaskGraph itself on unbounded memory
(the work-conserving loop of DISCO section 1, one op at a time per lane of each GPU: compute,
host-to-GPU loads, peer transfers; the lowest TaskGraph list position first among ready vertices),
with durations from a generic cost model (`Rates`). Loads then come in the order and at the pace
the link delivers them, and each kernel right after its operands arrive, so a weight serves all
its consumers back to back (weight reuse) before the next one lands. Loads are paced by memory: a
graph input starts only while the inputs loaded and not yet consumed on its GPU take at most
`INPUT_SHARE` of the arena (when a capacity is given), which keeps prefetch from crowding out
activations when memory is tight.

Measured against the rejected alternatives (benchmarks/bench_quality.py): depth-first from the
outputs (finishes one output's subtree, so a sequence-tiled LLaMA runs every
layer per tile and reloads each layer's weights once per tile), the TaskGraph's own list order
(good when the builder lays it out level by level, but at a tight capacity it loads a level's
weights before the activations of the level before are done with), and memory pacing of every
value instead of inputs only (stalls kernels whose outputs do not fit yet).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from disco_ray.graph import ops
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .bounds import peak_live, reload_bound
from .capacity import capacities
from .dense import Dense, check_order

__all__ = [
    "Rates",
    "check_order",
    "default",
    "default_order",
    "depth_first_order",
    "schedule",
    "schedule_order",
]

INPUT_SHARE = 0.5  # of an arena, for inputs loaded ahead of their consumers (see the header)
_COMPUTE, _LOAD, _PEER = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Rates:
    """The cost model of the schedule order: only ratios matter (an H100-like GPU by default)."""

    flops: float = 750e12  # kernel FLOP/s
    memory: float = 3e12  # bytes/s a kernel reads and writes
    load: float = 50e9  # host-to-GPU bytes/s
    peer: float = 400e9  # GPU-to-GPU bytes/s
    launch: float = 10e-6  # fixed cost of every vertex

    def durations(self, d: Dense) -> list[float]:
        """Seconds each vertex of `d` takes on its lane."""
        nb, sig, sigs, inputs = d.nbytes, d.sig, d.sigs, d.inputs
        launch, load, peer = self.launch, self.load, self.peer
        out = []
        seen: dict[tuple, float] = {}  # kernels of one signature cost the same: graphs repeat them
        for k, v in enumerate(d.tg):
            kind = v.kind
            if kind is Kind.INPUT:
                out.append(launch + nb[k] / load)
            elif kind is Kind.TRANSFER:
                out.append(launch + nb[k] / peer)
            else:
                attrs = v.attrs
                ins = inputs[k]
                # the signature: op and operand (shape, dtype) ids, then the attributes if any
                key = (
                    (v.op, *[sig[i] for i in ins], tuple(attrs.items()))
                    if attrs
                    else (v.op, *[sig[i] for i in ins])
                )
                try:
                    t = seen.get(key)
                    cache = True
                except TypeError:  # an unhashable attribute (a list): not cached
                    t, cache = None, False
                if t is None:
                    spec = ops.OPS[v.op]  # type: ignore[index]
                    work = 0.0
                    if spec.flops is not None:
                        shapes = [sigs[sig[i]][0] for i in ins]
                        work = float(spec.flops(shapes, v.shape, spec.full_attrs(v.attrs)))
                    moved = nb[k] + sum(nb[i] for i in ins)
                    t = launch + max(work / self.flops, moved / self.memory)
                    if cache:
                        seen[key] = t
                out.append(t)
        return out


def schedule_order(tg: TaskGraph, capacity: Sequence[int] | None = None, rates: Rates = Rates()) -> list[str]:
    """The start order of a list schedule of `tg` (see the module header): a topological order.

    Args:
        tg: the TaskGraph.
        capacity: arena bytes per GPU; inputs are paced to `INPUT_SHARE` of it (None: not paced).
        rates: the cost model.
    """
    d = Dense(tg)
    return [d.ids[k] for k in schedule(d, capacity, rates)]


def schedule(d: Dense, capacity: Sequence[int] | None = None, rates: Rates = Rates()) -> list[int]:
    """`schedule_order` on a flattened graph: vertex-list positions in start order."""
    n = len(d)
    G = d.gpus
    gpu = d.gpu
    lane = [_LOAD if k is Kind.INPUT else _PEER if k is Kind.TRANSFER else _COMPUTE for k in d.kind]
    dur = rates.durations(d)
    size = d.nbytes
    operands = d.operands
    succs: list[list[int]] = [[] for _ in range(n)]
    for k, ops_ in enumerate(operands):
        for i in ops_:
            succs[i].append(k)
    waiting = [len(ops_) for ops_ in operands]
    unread = [len(s) for s in succs]  # consumers not finished yet, per vertex
    is_input = [ln == _LOAD for ln in lane]
    budget = [float("inf")] * G if capacity is None else [INPUT_SHARE * c for c in capacity]
    ahead = [0] * G  # bytes of inputs started and not yet consumed by every reader
    ready: list[list[list[int]]] = [[[], [], []] for _ in range(G)]  # per GPU and lane: heap
    busy = [[False] * 3 for _ in range(G)]
    for k in range(n):
        if not waiting[k]:
            ready[gpu[k]][lane[k]].append(k)  # ascending k: already heaps
    events: list[tuple[float, int]] = []
    order: list[int] = []
    push, pop = heapq.heappush, heapq.heappop
    now = 0.0

    def dispatch(g: int, now: float) -> None:
        rg, bg = ready[g], busy[g]
        for ln in (_COMPUTE, _LOAD, _PEER):
            h = rg[ln]
            if h and not bg[ln]:
                k = h[0]
                if ln == _LOAD:
                    if ahead[g] and ahead[g] + size[k] > budget[g]:
                        continue  # paced: wait until consumers free some of the prefetched inputs
                    ahead[g] += size[k]
                pop(h)
                bg[ln] = True
                order.append(k)
                push(events, (now + dur[k], k))

    for g in range(G):
        dispatch(g, 0.0)
    while events or len(order) < n:
        if not events:  # only paced loads are ready: start the first of them anyway
            g = min((g for g in range(G) if ready[g][_LOAD]), key=lambda g: ready[g][_LOAD][0])
            budget[g] = float("inf")
            dispatch(g, now)
            budget[g] = INPUT_SHARE * capacity[g] if capacity is not None else float("inf")
            continue
        now, k = pop(events)
        g = gpu[k]
        busy[g][lane[k]] = False
        touched = None
        for i in operands[k]:
            left = unread[i] - 1
            unread[i] = left
            if not left and is_input[i]:
                ahead[gpu[i]] -= size[i]
                if gpu[i] != g:
                    touched = {gpu[i]} if touched is None else touched | {gpu[i]}
        for w in succs[k]:
            left = waiting[w] - 1
            waiting[w] = left
            if not left:
                push(ready[gpu[w]][lane[w]], w)
                if gpu[w] != g:
                    touched = {gpu[w]} if touched is None else touched | {gpu[w]}
        dispatch(g, now)
        if touched:
            for h in touched:
                dispatch(h, now)
    return order


def default_order(
    tg: TaskGraph, capacity: int | Sequence[int] | Mapping[int, int] | None = None
) -> list[str]:
    """The planner's default serial order for these capacities (see `default`)."""
    d = Dense(tg)
    return [d.ids[k] for k in default(d, None if capacity is None else capacities(capacity, tg.gpus))[0]]


def default(d: Dense, caps: Sequence[int] | None, alignment: int = 256) -> tuple[list[int], str]:
    """The schedule order, or the TaskGraph's list order where that needs fewer reloads: (order, name).

    At capacities so tight that the schedule order's live values do not fit at once, Belady's
    bound (planner.bounds) decides between the two; a tensor-parallel chain at the least
    capacity, for one, must finish each level before its next weights arrive.
    """
    seq = schedule(d, caps)
    if caps is None:
        return seq, "schedule"
    room = [c // alignment * alignment for c in caps]
    if all(p <= c for p, c in zip(peak_live(d, seq, d.sizes(alignment)), room)):
        return seq, "schedule"
    listed = list(range(len(d)))
    if sum(reload_bound(d, listed, caps, alignment)) < sum(reload_bound(d, seq, caps, alignment)):
        return listed, "list (fewer reloads than the schedule)"
    return seq, "schedule"


def random_order(tg: TaskGraph, seed: int) -> list[str]:
    """A topological order drawing a uniformly random ready vertex at each step (for tests and benchmarks)."""
    rng = random.Random(seed)
    indeg = {v.id: len(set(v.inputs)) for v in tg}
    consumers = tg.consumers()
    ready = [k for k, d in indeg.items() if d == 0]
    order = []
    while ready:
        k = ready.pop(rng.randrange(len(ready)))
        order.append(k)
        for c in consumers[k]:
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    return order


def depth_first_order(tg: TaskGraph) -> list[str]:
    """The former default: a depth-first post-order from the outputs (then other sinks), operands in order.

    Each operand, a weight say, comes just before its first consumer and one output's subtree is
    finished before the next starts. Kept for comparison (benchmarks/bench_quality.py).
    """
    consumed = {i for v in tg for i in v.inputs}
    kept = tg.kept
    keep = set(kept)
    roots = kept + [v.id for v in tg if v.id not in consumed and v.id not in keep]
    done: set[str] = set()
    order: list[str] = []
    verts = tg.vertices
    for root in roots:
        if root in done:
            continue
        stack = [(root, 0)]
        while stack:
            vid, i = stack[-1]
            ins = verts[vid].inputs
            while i < len(ins) and ins[i] in done:
                i += 1
            if i < len(ins):
                stack[-1] = (vid, i + 1)
                stack.append((ins[i], 0))
            else:
                stack.pop()
                if vid not in done:
                    done.add(vid)
                    order.append(vid)
    return order
