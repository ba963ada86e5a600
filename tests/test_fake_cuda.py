"""The stand-in CUDA (tests/fake_cuda.py, tests/fake_device.py) is strict: work runs later, on its
stream's thread, in launch order; waits order streams as on a device; a range being written
holds poison until its work has run; a stale event and an asynchronous error are reported. And
the cuda backend's launch loop, on it, orders kernels after the copies they read."""

from __future__ import annotations

import threading

import pytest
import torch

from actors.backends.base import Mode
from actors.backends.cuda import CudaBackend
from actors.executor import Executor
from actors.options import WorkerConfig
from actors.plans import PlanKind
from disco_ray.graph.reference import evaluate, random_inputs
from tests import fake_cuda
from tests.fake_cuda import POISON, FakeEvent, FakeStream, StaleEventError, install
from tests.runtime_helpers import plan, random_taskgraph

WAIT_S = 20.0  # bounds every wait: a hang fails the test instead of hanging it


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch.setattr)


def _after(stream: FakeStream) -> FakeEvent:
    ev = FakeEvent()
    ev.record(stream)
    return ev


def test_work_runs_later_on_its_streams_thread_in_launch_order(fake):
    s = FakeStream()
    ran: list = []
    for i in range(3):
        s.launch(lambda i=i: ran.append((i, threading.current_thread().name, fake_cuda._current() is s)))
    ev = _after(s)
    assert ran == [], "work ran at launch"
    assert ev.query()
    assert [i for i, _, _ in ran] == [0, 1, 2]
    assert {name for _, name, _ in ran} == {s.runner.name}, "work ran off its stream's thread"
    assert all(cur for _, _, cur in ran), "its stream was not current while it ran"


def test_a_wait_orders_streams_and_a_missing_one_does_not(fake):
    """B's kernel reads what A's copy writes: behind a wait it sees the copy; without one, the
    host needing B's result runs B alone, before the copy."""
    for wait in (True, False):
        a, b = FakeStream(), FakeStream()
        src, buf, out = torch.arange(8.0), torch.zeros(8), torch.zeros(8)
        a.launch(lambda buf=buf, src=src: buf.copy_(src))
        copied = _after(a)
        if wait:
            b.wait_event(copied)
        b.launch(lambda out=out, buf=buf: out.copy_(buf * 2))
        _after(b).synchronize()
        assert torch.equal(out, torch.arange(8.0) * 2) == wait, f"wait={wait}: {out}"


def test_an_error_of_work_is_raised_by_the_next_event_of_its_stream(fake):
    s = FakeStream()
    s.launch(lambda: 1 / 0)
    ev = _after(s)
    with pytest.raises(ZeroDivisionError):
        ev.query()
    assert _after(s).query(), "the error was reported once, by the event after it"


def test_a_wait_on_an_event_of_an_earlier_run_is_stale(fake):
    """A point (a vertex's start event) that waits on the record it already waited on in the
    last run: its launcher has not recorded that event in this run yet."""
    a, b = FakeStream(), FakeStream()
    u_end, v_start = FakeEvent(), FakeEvent()
    for _ in range(2):  # two runs in order: u recorded, then v waits on it
        u_end.record(a)
        b.wait_event(u_end)
        v_start.record(b)
    b.wait_event(u_end)  # a third run where v goes first
    with pytest.raises(StaleEventError, match="earlier run"):
        v_start.record(b)


def test_synchronize_runs_every_stream(fake):
    s, x = FakeStream(), torch.zeros(4)
    s.launch(lambda: x.fill_(1))
    fake.torch.cuda.synchronize()
    assert x.eq(1).all()


def test_a_range_being_written_holds_poison_until_its_work_ran(fake):
    """The executor's own work for kernels and loads, enqueued as the loop does: once what it
    waits on has run, and until the stream runs it, its output holds poison (a host read without
    a synchronisation sees it); after, the value."""
    tg = random_taskgraph(3, n=20, gpus=1, size=8)
    mg = plan(tg, "roomy")
    be = CudaBackend()
    ex = Executor(0, mg, tg, WorkerConfig(streams=2, ahead=0), backend=be)
    try:
        inputs = random_inputs(tg, 0)
        ex.begin(inputs)
        enqueue = fake_cuda.deferred(ex._work, be.streams, {})
        kinds = {PlanKind.INPUT: ex.h2d, PlanKind.KERNEL: 0}
        seen, ends = set(), {}
        for vid in sorted(ex.plans):  # the planner's order: a kernel after the loads it reads
            p = ex.plans[vid]
            s = kinds.get(p.kind)
            if s is None:
                continue
            stream = be.streams[s]
            for u in mg.vertex(vid).ins:  # as the loop: wait on what it reads
                if u.src is not None and u.src in ex.plans:
                    stream.wait_event(ends[u.src])
            fake.torch.cuda.synchronize()  # what it waits on and its stream's earlier work have run
            with fake_cuda._stream_ctx(stream):
                enqueue(vid, s)
            out = p.out.reshape(-1).view(torch.uint8)
            assert out.eq(POISON).all(), f"vertex {vid}: its output was written at launch"
            ends[vid] = _after(stream)
            seen.add(p.kind)
        for vid, ev in ends.items():
            ev.synchronize()
            assert not ex.plans[vid].out.reshape(-1).view(torch.uint8).eq(POISON).all(), vid
        assert seen == set(kinds)
        ref = evaluate(tg, inputs)
        for name in tg.outputs:
            vid = mg.outputs[name]
            if vid in ends:
                torch.testing.assert_close(ex.plans[vid].out.reshape(ref[name].shape), ref[name])
    finally:
        ex.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_kernels_launched_ahead_wait_on_the_copies_they_read(monkeypatch, fake, seed):
    """The launch loop with its default launch ahead on a tight plan: kernels launched behind the
    loads they read (on the H2D lane) wait on them, so the outputs match the reference over two
    runs (a missing wait reads poison: NaN)."""
    tg = random_taskgraph(seed, n=60, gpus=1, size=16)
    mg = plan(tg, "tight")
    be = CudaBackend()
    ex = Executor(0, mg, tg, WorkerConfig(streams=2), backend=be)
    assert ex.ahead == CudaBackend.default_ahead > 0
    submitted: list = []
    submit = be.loop.submit
    monkeypatch.setattr(
        be.loop, "submit", lambda s, vid, w, m: (submitted.append((s, w)), submit(s, vid, w, m))
    )
    try:
        for run in range(2):
            inputs = random_inputs(tg, seed + run)
            ex.begin(inputs)
            ex.dispatch(list(ex.core.mine))
            assert ex.wait(timeout=WAIT_S) and ex.error is None, ex.error
            ref = evaluate(tg, inputs)
            for name in tg.outputs:
                got = ex.output(name, mg.outputs[name])
                torch.testing.assert_close(
                    got, ref[name], rtol=1e-4, atol=1e-4, msg=f"seed {seed} run {run} {name}"
                )
        lane_of = {vid: s for vid, s, *_ in ex.trace}
        crossing = [1 for s, waits in submitted if s < ex.streams for u in waits if lane_of.get(u) == ex.h2d]
        assert crossing, "no kernel waited on a load: the test shows nothing"
        assert all(m != Mode.BLOCKING for m in be.loop.modes.values())
    finally:
        ex.close()
