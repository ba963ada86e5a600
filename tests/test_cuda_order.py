"""Orders of completions on the cuda backend's loop (stand-in device, tests/fake_cuda.py): NCCL
with launch ahead never deadlocks, a ready kernel keeps its priority under launch ahead, and a
vertex whose launch raises ends its run without holding the worker's next one.

The search of orders runs random graphs over 3 GPUs, each planned in a random serial order (the
planner numbers vertices in it, and NCCL posts in that numbering) and run with random kernel
durations (`RunOptions.delay`), for ahead 0, 1 and 4; the review's case is a fixed one of them.
"""

from __future__ import annotations

import collections
import itertools
import random

import pytest
import torch

from actors import resources
from actors.backends.base import Mode
from actors.backends.cuda import CudaBackend
from actors.executor import Executor
from actors.options import RunOptions, WorkerConfig
from actors.slots import StreamSlots
from actors.transports.local import LocalTransport
from actors.worker_core import WorkerCore
from disco_ray.driver.engine_local import LocalEngine
from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MKind
from disco_ray.graph.reference import evaluate, random_inputs
from disco_ray.graph.taskgraph import TaskGraph
from planner import build_memgraph
from tests.fake_cuda import FakeStream, install
from tests.runtime_helpers import plan, random_taskgraph
from tests.test_nccl import nccl_engine
from tests.test_scheduler import _drive, mgraph

WAIT_S = 20.0  # a deadlocked run fails after this instead of hanging the suite
AHEADS = (0, 1, 4)


def _same(out, ref, what):
    assert set(out) == set(ref), what
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], rtol=1e-4, atol=1e-4, msg=f"output {k!r}, {what}")


# ---- NCCL with launch ahead ---------------------------------------------------------------------
def reviews_case() -> tuple[TaskGraph, list[str]]:
    """gpu:1 receives r0 (from gpu:0's chain a0..a2) and r (from gpu:2's one kernel), and sends t
    (of s, which needs r0) to gpu:0. In this serial order r0 < t < r: gpu:1's channel posts r
    after t. At run time r arrives first; k, which needs r, was launched ahead behind it and held
    the one compute stream, where s then queued: t never went, so neither did r (9 of 17 done)."""
    g = TaskGraph(gpus=3)
    a, b, c = (g.input(f"in_{x}", (8, 8), "float32", gpu=q) for q, x in enumerate("abc"))
    x = a
    for i in range(3):
        x = g.silu(x, id=f"a{i}")
    s = g.add(g.silu(b, id="p"), g.transfer(x, gpu=1, id="r0"), id="s")
    k = g.silu(g.transfer(g.silu(c, id="c_src"), gpu=1, id="r"), id="k")
    z = g.silu(g.transfer(b, gpu=2, id="tz"), id="z")  # gpu:2 receives too (every member has a lane)
    g.output(g.add(g.transfer(s, gpu=0, id="t"), x, id="y"), g.silu(k, id="k2"), z)
    order = ["in_a", "in_b", "in_c", "a0", "a1", "a2", "p", "r0", "s", "t", "y", "tz", "z", "c_src"]
    order += ["r", "k", "k2"]
    return g, order


def random_order(tg: TaskGraph, rng: random.Random) -> list[str]:
    """A random topological order of `tg`'s vertices (Kahn's, a random ready vertex each step)."""
    preds = {v.id: set(v.inputs) for v in tg}
    succs: dict[str, set[str]] = collections.defaultdict(set)
    for v in tg:
        for u in v.inputs:
            succs[u].add(v.id)
    ready = sorted(v for v, p in preds.items() if not p)
    order = []
    while ready:
        v = ready.pop(rng.randrange(len(ready)))
        order.append(v)
        for w in sorted(succs[v]):
            preds[w].discard(v)
            if not preds[w]:
                ready.append(w)
    return order


def nccl_run(monkeypatch, tg, mg, ahead: int, seed: int, streams: int = 1) -> None:
    eng, _ = nccl_engine(monkeypatch, tg, mg, streams=streams, ahead=ahead)
    try:
        inputs = random_inputs(tg, seed)
        out, _ = eng.run(inputs, RunOptions(delay=(0, 3e-3), seed=seed, timeout=WAIT_S))
        _same(out, evaluate(tg, inputs), f"seed {seed}, ahead {ahead}")
    finally:
        eng.close()


@pytest.mark.parametrize("ahead", AHEADS)
def test_the_reviews_case_finishes(monkeypatch, ahead):
    """The review's deadlock (the planner's numbering of its serial order): every ahead finishes
    with the reference's outputs (before: ahead 1 and 4 'did not finish', 9 of 17 done)."""
    tg, order = reviews_case()
    mg = build_memgraph(tg, 1 << 24, order=order)
    ids = {v.value: v.id for v in mg.vertices if v.kind is MKind.TRANSFER}
    assert ids["r0"] < ids["t"] < ids["r"], ids  # the numbering the case needs
    for seed in range(2):
        nccl_run(monkeypatch, tg, mg, ahead, seed)


def _with_transfers_both_ways(mg) -> bool:
    return {v.gpu for v in mg.vertices if v.kind is MKind.TRANSFER} == set(range(mg.gpus))


@pytest.mark.parametrize("ahead", AHEADS)
def test_no_order_of_completions_deadlocks_nccl(monkeypatch, ahead):
    """Random graphs over 3 GPUs, random serial orders, random kernel durations: every run
    finishes with the reference's outputs."""
    rng = random.Random(27 + ahead)
    runs = 0
    while runs < 6:
        seed = rng.randrange(10**6)
        tg = random_taskgraph(seed, n=24, gpus=3, size=8)
        mg = build_memgraph(tg, 1 << 24, order=random_order(tg, random.Random(seed)))
        if not _with_transfers_both_ways(mg):
            continue
        runs += 1
        try:
            nccl_run(monkeypatch, tg, mg, ahead, seed, streams=1 + seed % 2)
        except RunError as e:
            raise AssertionError(f"graph seed {seed}, ahead {ahead}: {e}") from e


# ---- a ready kernel keeps its priority under launch ahead --------------------------------------
def two_chains_and_a_ready_kernel() -> tuple[TaskGraph, list[str]]:
    """On gpu:0, chains a1..a8 and b1..b8 keep both compute streams full under launch ahead; `r`
    needs only `t`, a transfer from gpu:1 (BLOCKING in the test: nothing goes ahead behind it),
    so it becomes ready when `t` lands, and it has a lower id than every kernel but a1 and b1."""
    g = TaskGraph(gpus=2)
    x, y, z = (
        g.input("x", (8, 8), "float32"),
        g.input("y", (8, 8), "float32"),
        g.input("z", (8, 8), "float32", gpu=1),
    )
    a, b = x, y
    for i in range(1, 9):
        a, b = g.silu(a, id=f"a{i}"), g.silu(b, id=f"b{i}")
    r = g.silu(g.transfer(g.silu(z, id="w"), gpu=0, id="t"), id="r")
    g.output(a, b, r)
    order = ["x", "y", "z", "a1", "b1", "w", "t", "r"] + [f"{c}{i}" for i in range(2, 9) for c in "ab"]
    return g, order


@pytest.mark.parametrize("ahead", (1, 4))
def test_a_ready_kernel_is_launched_before_later_chain_kernels_pure(ahead):
    """StreamSlots alone: kernel 5, ready once copy 4 lands (a copy another thread runs: nothing
    goes ahead behind it), is launched then, before the chains' later kernels, all of higher ids
    (before: after 15 of 17 completions, once a chain ended and freed a stream)."""
    # 0, 1: inputs; chain A 2, 6, 8, .., 18; chain B 3, 7, 9, .., 19; reload 4 after 2; 5 after 4
    chain_a, chain_b = [2, *range(6, 19, 2)], [3, *range(7, 20, 2)]
    edges = [(0, 2), (1, 3), (2, 4), (4, 5)] + [
        (u, w) for c in (chain_a, chain_b) for u, w in itertools.pairwise(c)
    ]
    mg = mgraph([0] * 20, edges, {0: MKind.INPUT, 1: MKind.INPUT, 4: MKind.RELOAD})
    slots = StreamSlots(WorkerCore(mg, 0), streams=2, lane_limits=[2])
    slots.start(ahead=ahead, lane_of={0: 2, 1: 2, 4: 2}, aside={4})
    slots.core.dispatch(range(20))
    at, completed = _drive(slots)
    assert set(at) == set(completed) == set(range(20))
    # at once, or at the next completion when every stream holds ahead + 1
    assert at[5] - completed[4] <= 1, f"ready at completion {completed[4]}, launched at {at[5]}"


@pytest.mark.parametrize("ahead", (1, 4))
def test_a_ready_kernel_is_launched_before_later_chain_kernels(monkeypatch, ahead):
    """On the stand-in: `r` is launched in the pass that completes `t`, its one predecessor, or
    at the next completion when both streams are full (before: after most of the chains)."""
    install(monkeypatch.setattr)
    monkeypatch.setattr(resources, "make_backend", lambda name, device=None: CudaBackend())
    monkeypatch.setattr(LocalTransport, "mode", lambda self, src: Mode.BLOCKING)  # a helper runs it
    monkeypatch.setattr(FakeStream, "device_s", 2e-3)  # the chains run while `t` comes
    tg, order = two_chains_and_a_ready_kernel()
    mg = build_memgraph(tg, 1 << 24, order=order)
    vid = {v.value: v.id for v in mg.vertices if v.gpu == 0}
    assert vid["r"] < min(vid[f"{c}{i}"] for c in "ab" for i in range(2, 9))
    eng = LocalEngine(tg, mg, config=WorkerConfig(backend="cuda", streams=2, ahead=ahead))
    loop = eng.execs[0].backend.loop
    log: list[tuple[str, int]] = []
    done, submit = loop.done, loop.submit
    loop.done = lambda v, *a: (log.append(("done", v)), done(v, *a))[1]
    monkeypatch.setattr(loop, "submit", lambda s, v, *a: (log.append(("submit", v)), submit(s, v, *a))[1])
    try:
        inputs = random_inputs(tg, 0)
        out, _ = eng.run(inputs, RunOptions(timeout=WAIT_S))
        _same(out, evaluate(tg, inputs), "chains")
    finally:
        eng.close()
    ready_at = log.index(("done", vid["t"]))
    between = [v for what, v in log[ready_at + 1 : log.index(("submit", vid["r"]))] if what == "done"]
    assert len(between) <= 1, f"r waited for {len(between)} completions after it was ready"


# ---- a vertex whose launch raises ----------------------------------------------------------------
@pytest.mark.parametrize("ahead", (0, 4))
def test_a_launch_that_raises_ends_its_run_and_the_next_run_works(monkeypatch, ahead):
    """A bug in the launch path of one vertex (here: `_launch` raises): the run fails naming that
    vertex, and the next run on the same executor works (before, the vertex never ended, so the
    worker refused every later run: 'a run is still in progress')."""
    install(monkeypatch.setattr)
    tg = random_taskgraph(62, n=30, gpus=1, size=8)
    mg = plan(tg, "roomy")
    be = CudaBackend()
    ex = Executor(0, mg, tg, WorkerConfig(streams=2, ahead=ahead), backend=be)
    victim = next(v.id for v in mg.vertices if v.kind is MKind.KERNEL)
    launch = be.loop._launch
    armed = [True]

    def raising(vid, s, waits):
        if vid == victim and armed[0]:
            armed[0] = False
            raise RuntimeError("a bug in the launch path")
        return launch(vid, s, waits)

    monkeypatch.setattr(be.loop, "_launch", raising)
    try:
        ex.begin(random_inputs(tg, 0))
        ex.dispatch(list(ex.core.mine))
        assert ex.wait(WAIT_S), "the failed run never ended"
        assert ex.error is not None and f"vertex {victim} " in ex.error, ex.error
        assert "a bug in the launch path" in ex.error, ex.error
        inputs = random_inputs(tg, 1)
        ex.begin(inputs)
        ex.dispatch(list(ex.core.mine))
        assert ex.wait(WAIT_S) and ex.error is None, ex.error
        _same({k: ex.output(k, mg.outputs[k]) for k in tg.outputs}, evaluate(tg, inputs), "next run")
    finally:
        ex.close()
