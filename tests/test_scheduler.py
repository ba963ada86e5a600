"""The pure cores (actors.scheduler.Scheduler, actors.worker_core.WorkerCore) driven by events."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.scheduler import Abort, Completed, Dispatch, Finished, Scheduler, WorkerFailed
from actors.slots import StreamSlots
from actors.worker_core import WorkerCore
from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import HOST, Loc, MemGraph, MemVertex, MKind, Read


def mgraph(gpus: list[int], edges: list[tuple[int, int]], kinds: dict[int, MKind] | None = None) -> MemGraph:
    """Vertex i runs on gpus[i]; locations are dummies (the cores only read ids, GPUs and edges)."""
    kinds = kinds or {}
    verts = [
        MemVertex(i, kinds.get(i, MKind.KERNEL), f"v{i}", g, (), Loc(g, 256 * i, 256))
        for i, g in enumerate(gpus)
    ]
    return MemGraph([1 << 20] * (max(gpus) + 1), verts, [(u, w, "data") for u, w in edges], {})


def fig3_memgraph() -> MemGraph:
    """TURNIP Figure 5 shape: inputs on 3 GPUs, kernels, transfers and a memory edge (hand-made)."""
    verts = [
        MemVertex(0, MKind.INPUT, "A", 0, (), Loc(0, 0, 256)),
        MemVertex(1, MKind.INPUT, "B", 1, (), Loc(1, 0, 256)),
        MemVertex(2, MKind.KERNEL, "k1", 0, (Read("A", 0, Loc(0, 0, 256)),), Loc(0, 256, 256)),
        MemVertex(3, MKind.KERNEL, "k2", 1, (Read("B", 1, Loc(1, 0, 256)),), Loc(1, 256, 256)),
        MemVertex(4, MKind.TRANSFER, "t1", 2, (Read("k1", 2, Loc(0, 256, 256)),), Loc(2, 0, 256)),
        MemVertex(5, MKind.TRANSFER, "t2", 2, (Read("k2", 3, Loc(1, 256, 256)),), Loc(2, 256, 256)),
        MemVertex(
            6,
            MKind.KERNEL,
            "k3",
            2,
            (Read("t1", 4, Loc(2, 0, 256)), Read("t2", 5, Loc(2, 256, 256))),
            Loc(2, 512, 256),
        ),
        MemVertex(7, MKind.OFFLOAD, "k3", 2, (Read("k3", 6, Loc(2, 512, 256)),), Loc(HOST, 0, 256)),
        MemVertex(8, MKind.KERNEL, "k4", 0, (Read("k1", 2, Loc(0, 256, 256)),), Loc(0, 0, 256)),
    ]
    edges = [
        (0, 2, "data"),
        (1, 3, "data"),
        (2, 4, "data"),
        (3, 5, "data"),
        (4, 6, "data"),
        (5, 6, "data"),
        (6, 7, "data"),
        (2, 8, "data"),
        (4, 8, "mem"),
    ]  # 8 overwrites A: after the transfer read k1
    return MemGraph([4096] * 3, verts, edges, {"k3": 7, "k4": 8})


def test_start_dispatches_vertices_without_remote_preds():
    s = Scheduler(fig3_memgraph())
    out = s.start()
    # 6 and 7 depend only on vertices of their own gpu 2: handed over at once, released there locally
    assert out == [Dispatch(0, [0, 2]), Dispatch(1, [1, 3]), Dispatch(2, [6, 7])]
    assert s.held_by(0) == [0, 2]


def test_cross_worker_edges_go_through_the_coordinator():
    s = Scheduler(fig3_memgraph())
    s.start()
    assert s.handle(Completed(0, [0])) == []
    assert s.handle(Completed(0, [2])) == [Dispatch(2, [4])]
    assert s.handle(Completed(1, [1, 3])) == [Dispatch(2, [5])]
    # 8 has a local pred (2) and a remote one (the transfer 4): it waits for 4's report
    assert s.handle(Completed(2, [4])) == [Dispatch(0, [8])]
    assert s.handle(Completed(2, [5, 6])) == []
    assert s.handle(Completed(0, [8])) == []
    assert s.handle(Completed(2, [7])) == [Finished()]
    assert s.statistics()["cross_worker_edges"] == 3


def test_dispatch_is_once_and_finish_is_signalled():
    mg = fig3_memgraph()
    s = Scheduler(mg)
    got = {d.gpu: list(d.vids) for d in s.start()}
    seen = [v for vs in got.values() for v in vs]
    order = [(0, [0, 2]), (1, [1, 3]), (2, [4, 5]), (2, [6, 7]), (0, [8])]
    out = []
    for g, vids in order:
        for i in s.handle(Completed(g, vids)):
            out.append(i)
            if isinstance(i, Dispatch):
                seen += i.vids
    assert sorted(seen) == list(range(9))
    assert isinstance(out[-1], Finished)
    assert s.state == "finished"


def test_unheld_report_and_failure_abort():
    s = Scheduler(fig3_memgraph())
    s.start()
    out = s.handle(Completed(0, [4]))  # vertex 4 belongs to gpu 2 and was never handed out
    assert len(out) == 1 and isinstance(out[0], Abort) and "gpu:0" in out[0].message
    s.start()
    out = s.handle(WorkerFailed(1, 3, "gpu:1 vertex 3 raised"))
    assert out == [Abort("gpu:1 vertex 3 raised")]
    assert s.handle(Completed(0, [0])) == []  # nothing after a failure


def test_worker_core_runs_a_chain_locally_lowest_id_first():
    mg = mgraph([0, 0, 0, 0, 0], [(0, 2), (1, 2), (2, 3)])
    w = WorkerCore(mg, 0)
    w.dispatch([4, 3, 2, 1, 0])
    assert [w.pop(), w.pop(), w.pop()] == [0, 1, 4]
    assert w.pop() is None
    w.complete(0)
    assert w.pop() is None
    w.complete(1)
    assert w.pop() == 2
    w.complete(2)
    assert w.pop() == 3


def test_worker_core_queues_kernels_behind_launched_predecessors():
    # 0 input -> 1 kernel -> 2 kernel; 0 -> 3 reload (a copy: never queued); 4 kernel on gpu 1 -> 2
    kinds = {0: MKind.INPUT, 3: MKind.RELOAD}
    mg = mgraph([0, 0, 0, 0, 1], [(0, 1), (1, 2), (0, 3), (4, 2)], kinds)
    w = WorkerCore(mg, 0)
    w.dispatch([0, 1, 3])
    assert w.pop() == 0 and w.pop() is None
    assert w.pop_queued() is None  # nothing launched yet
    w.launch(0)
    assert w.pop_queued() == 1  # its one predecessor is launched
    assert w.pop_queued() is None  # 3 is a copy: it waits until 0 is done
    w.launch(1)
    assert w.pop_queued() is None  # 2 is not dispatched yet (its predecessor 4 is on gpu 1)
    w.dispatch([2])
    assert w.pop_queued() == 2
    w.complete(0)
    assert w.pop() == 3  # ready now; 1 was launched, so it is not ready a second time
    assert w.pop() is None
    w.complete(1)
    assert w.pop() == 2  # its predecessors are done: served as ready ...
    assert w.pop_queued() is None  # ... and no longer as queued
    w.launch(2)
    w.complete(2)
    w.launch(3)
    w.complete(3)
    assert w.finished


def test_stream_slots_put_a_chain_behind_itself_and_loads_on_free_streams():
    # 0, 1 inputs -> 2 kernel(0) -> 3 kernel(2, 1); 4 input on its own
    kinds = {0: MKind.INPUT, 1: MKind.INPUT, 4: MKind.INPUT}
    mg = mgraph([0] * 5, [(0, 2), (2, 3), (1, 3)], kinds)
    slots = StreamSlots(WorkerCore(mg, 0), streams=2)
    slots.start(ahead=2)
    slots.core.dispatch(range(5))
    # ready inputs 0 and 1 on the two free streams; 2 behind 0; 3 behind 2, waiting on 1; the
    # ready 4 behind the least busy stream (no stream is free)
    assert slots.take() == [(0, 0, ()), (1, 1, ()), (2, 0, ()), (3, 0, (1,)), (4, 1, ())]
    assert slots.depth == [3, 2] and slots.launched_ahead == 2
    for vid, s in [(1, 1), (0, 0)]:
        slots.core.complete(vid)
        slots.landed(vid, s)
    assert slots.take() == []
    slots.start(ahead=0)  # a new run without launch ahead: only ready vertices, one per stream
    slots.core.dispatch(range(5))
    assert slots.take() == [(0, 0, ()), (1, 1, ())] and slots.launched_ahead == 0


def test_worker_core_waits_for_dispatch_of_remote_ready_vertices():
    mg = mgraph([0, 1, 0], [(0, 2), (1, 2)])
    w = WorkerCore(mg, 0)
    w.dispatch([0])
    assert w.pop() == 0
    w.complete(0)
    assert w.pop() is None  # 2 still needs the coordinator (its pred 1 is on gpu 1)
    w.dispatch([2])
    assert w.pop() == 2


def simulate(mg: MemGraph, rng: random.Random, streams: int = 2, ahead: bool = False) -> list[int]:
    """Cores + a random message schedule: reports and dispatches are delayed and batched at random.

    With `ahead`, queued kernels are also launched (into `waiting`, the way an executor hands
    them to a stream) and start only once their predecessors are done."""
    s = Scheduler(mg)
    cores = [WorkerCore(mg, g) for g in range(mg.gpus)]
    for c in cores:
        c.start(ahead=ahead)
    gpu_of = {v.id: v.gpu for v in mg}
    preds: dict[int, set[int]] = {v.id: set() for v in mg}
    for u, w, _ in mg.edges:
        preds[w].add(u)
    launched: set[int] = set()
    waiting: list[list[int]] = [[] for _ in cores]
    inbox: list[Dispatch] = [i for i in s.start() if isinstance(i, Dispatch)]
    running: list[list[int]] = [[] for _ in cores]
    unreported: list[list[int]] = [[] for _ in cores]
    done: list[int] = []
    finished = False
    for _ in range(100 * len(mg) + 100):
        if finished:
            break
        choice = rng.random()
        g = rng.randrange(mg.gpus)
        if choice < 0.3 and inbox:
            d = inbox.pop(rng.randrange(len(inbox)))
            cores[d.gpu].dispatch(d.vids)
        elif choice < 0.5:
            while len(running[g]) < streams and (v := cores[g].pop()) is not None:
                assert preds[v] <= set(done), f"vertex {v} started before its preds {preds[v] - set(done)}"
                assert v not in launched, f"vertex {v} launched twice"
                launched.add(v)
                cores[g].launch(v)
                running[g].append(v)
        elif choice < 0.6 and ahead:
            if (v := cores[g].pop_queued()) is not None:
                assert v not in launched, f"vertex {v} launched twice"
                assert mg.vertex(v).kind is MKind.KERNEL, f"copy {v} launched ahead"
                local = {u for u in preds[v] if gpu_of[u] == g}
                assert local <= launched, f"vertex {v} launched before its preds {local - launched}"
                assert preds[v] - local <= set(done), f"vertex {v} launched before its remote preds"
                assert not preds[v] <= set(done), f"ready vertex {v} served as queued"
                launched.add(v)
                cores[g].launch(v)
                waiting[g].append(v)
            for v in [v for v in waiting[g] if preds[v] <= set(done)]:  # its stream reached it
                waiting[g].remove(v)
                running[g].append(v)
        elif choice < 0.85 and running[g]:
            v = running[g].pop(rng.randrange(len(running[g])))
            done.append(v)
            cores[g].complete(v)
            unreported[g].append(v)
        elif unreported[g]:
            for i in s.handle(Completed(g, unreported[g])):
                if isinstance(i, Dispatch):
                    inbox.append(i)
                elif isinstance(i, Finished):
                    finished = True
            unreported[g] = []
    assert finished, f"not finished: {len(done)} of {len(mg)} done"
    assert not any(waiting), waiting
    return done


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.booleans())
def test_random_dags_complete_in_dependency_order(seed, ahead):
    """Every vertex runs once, after its predecessors; launched ahead only when its local
    predecessors are launched and its remote ones done (and never a copy)."""
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    gpus = [rng.randrange(3) for _ in range(n)]
    gpus[0] = 0
    gpus[-1] = max(gpus[-1], 2) if n > 1 else 0
    edges = [(u, w) for w in range(n) for u in range(w) if rng.random() < 0.15]
    kinds = {v: rng.choice([MKind.KERNEL, MKind.KERNEL, MKind.RELOAD]) for v in range(n)}
    mg = mgraph(gpus, edges, kinds)
    done = simulate(mg, rng, ahead=ahead)
    assert sorted(done) == list(range(n)), f"seed {seed}"


def _drive(slots, steps=200):
    """Completes launched vertices in launch order (a device running each stream in order),
    taking after each completion; returns ({vid: the number of completions before its launch},
    {vid: its completion's number, from 1})."""
    launched_at: dict[int, int] = {}
    completed: dict[int, int] = {}
    fifo = []
    done = 0
    for vid, s, _ in slots.take():
        launched_at[vid] = done
        fifo.append((vid, s))
    while fifo and steps:
        steps -= 1
        # the oldest launch whose local predecessors are done and that heads its stream
        k = next(
            i for i, (v, s) in enumerate(fifo) if slots.core.left[v] == 0 and all(t != s for _, t in fifo[:i])
        )
        vid, s = fifo.pop(k)
        slots.core.complete(vid)
        slots.landed(vid, s)
        done += 1
        completed[vid] = done
        for w, t, _ in slots.take():
            launched_at[w] = done
            fifo.append((w, t))
    return launched_at, completed


def test_a_ready_copy_gets_its_lane_at_once_whatever_kernels_run_ahead():
    """Two chains of 8 kernels keep both compute streams full with launch ahead 4; a reload that
    becomes ready when the first kernel completes is launched right then on its lane (before,
    copies took a free compute stream, and this one waited for a chain to end)."""
    # 0, 1: inputs; 2..9 chain A (on 0); 10..17 chain B (on 1); 18 reload after 2; 19 uses 18 and 9
    kinds = {0: MKind.INPUT, 1: MKind.INPUT, 18: MKind.RELOAD}
    edges = [(0, 2), (1, 10), (2, 18), (18, 19), (9, 19)]
    edges += [(v, v + 1) for v in range(2, 9)] + [(v, v + 1) for v in range(10, 17)]
    mg = mgraph([0] * 20, edges, kinds)
    slots = StreamSlots(WorkerCore(mg, 0), streams=2, lane_limits=[2])  # lane 2: host-to-device
    slots.start(ahead=4, lane_of={0: 2, 1: 2, 18: 2})
    slots.core.dispatch(range(20))
    at, completed = _drive(slots)
    assert set(at) == set(completed) == set(range(20))
    late = at[18] - completed[2]
    assert late == 0, f"the reload, ready at completion {completed[2]}, waited for {late} more"
    assert slots.running == 0


def test_copy_lanes_have_limits_and_kernels_never_use_them():
    kinds = {v: MKind.INPUT for v in range(5)}
    mg = mgraph([0] * 6, [(v, 5) for v in range(5)], kinds)
    slots = StreamSlots(WorkerCore(mg, 0), streams=1, lane_limits=[2, None])
    slots.start(ahead=0, lane_of={0: 1, 1: 1, 2: 1, 3: 2, 4: 2})
    slots.core.dispatch(range(6))
    got = slots.take()
    assert got == [(0, 1, ()), (1, 1, ()), (3, 2, ()), (4, 2, ())]  # lane 1 holds 2; lane 2 has no limit
    slots.core.complete(0)
    slots.landed(0, 1)
    assert slots.take() == [(2, 1, ())]
    for v, s in [(1, 1), (2, 1), (3, 2), (4, 2)]:
        slots.core.complete(v)
        slots.landed(v, s)
    assert slots.take() == [(5, 0, ())]  # the kernel on the compute stream
    with pytest.raises(RunError, match="lane 0"):
        slots.start(0, lane_of={0: 0})
