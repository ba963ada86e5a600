"""A worker's completion reports (actors/reporter.py): the pure decisions with a fake clock, and
what the coordinator knows when a worker fails."""

from __future__ import annotations

import collections

import pytest

from actors.reporter import BUDGET, Reporter
from disco_ray.graph.errors import RunError
from tests.runtime_helpers import noop_op  # noqa: F401  (fixture)


class _RacingQueue(collections.deque):
    """A queue whose length, when first read, has another thread's completion land: appended and
    flagged urgent exactly between the reporter's reads (the race, made deterministic)."""

    def __init__(self, reporter: Reporter, vid: int):
        super().__init__()
        self.reporter, self.vid, self.raced = reporter, vid, False

    def __len__(self):
        n = super().__len__()
        if not self.raced:
            self.raced = True
            self.reporter.completed(self.vid, urgent=True)  # appended after `n` was read
        return n


def test_an_urgent_completion_is_never_left_without_its_flag():
    """A completion another GPU waits for lands while the reporter decides: it is either in the
    batch or still flagged urgent, so it goes within flush_s, not lazy_s (clearing the flag after
    reading the queue lost it)."""
    r = Reporter(flush_s=1e-3, lazy_s=0.05)
    r.sent_at = 0.0  # a report just went
    r.queue = _RacingQueue(r, 2)
    r.queue.append(1)
    batch = r.take(now=0.0, busy=True)  # 1 is not urgent and the batch is young: nothing yet...
    assert batch is None
    assert r.urgent, "the urgent completion lost its flag"
    assert r.take(now=1e-3, busy=True) == [1, 2]  # ...and the next look sends both at once


def test_a_busy_worker_holds_back_only_what_nobody_waits_for():
    r = Reporter(flush_s=1e-3, lazy_s=0.05)
    r.completed(1, urgent=False)
    assert r.take(0.0, busy=True) == [1]  # the first report of a busy stretch goes at once
    r.completed(2, urgent=False)
    assert r.take(0.0005, busy=True) is None
    r.completed(3, urgent=True)
    assert r.take(0.0006, busy=True) == [2, 3]
    r.completed(4, urgent=False)
    assert r.take(0.0007, busy=False) == [4]  # idle: at once
    assert r.take(1.0, busy=False) is None  # nothing queued


def test_the_lazy_interval_follows_the_cost_of_a_report():
    """Reports nobody waits for go every BUDGET x (mean report call time), between flush_s and
    lazy_s: a cheap call keeps the coordinator's view about a millisecond old, a costly one takes
    at most ~1/BUDGET of the time."""
    r = Reporter(flush_s=1e-3, lazy_s=0.05)
    assert r.interval == 1e-3
    r.completed(1, urgent=False)
    r.take(0.0, busy=True)
    r.timed(2e-4)
    assert r.interval == BUDGET * 2e-4
    r.completed(2, urgent=False)
    assert r.take(BUDGET * 2e-4 * 0.9, busy=True) is None
    assert r.take(BUDGET * 2e-4, busy=True) == [2]
    for _ in range(30):
        r.timed(1.0)
    assert r.interval == 0.05


def test_a_failing_worker_reports_what_it_completed_before_the_failure(monkeypatch, noop_op):  # noqa: F811
    """GPU 0 runs a chain with lazy reports held back (costly report calls, 100 s at most); a
    kernel in it fails. Its earlier completions reach the coordinator before the failure, so
    the vertices the coordinator says gpu:0 held are exactly those it had not finished (before,
    they came after the failure, which the coordinator no longer counts)."""
    from actors.options import RunOptions, WorkerConfig
    from disco_ray.driver.engine_local import LocalEngine
    from planner import build_memgraph
    from tests.test_runtime_local import noop_graph

    monkeypatch.setattr(Reporter, "timed", lambda self, seconds: setattr(self, "call_s", 100.0))
    tg = noop_graph(fail_at="n30", gpus=1, n=40)
    mg = build_memgraph(tg, 1 << 20)
    eng = LocalEngine(tg, mg, config=WorkerConfig(streams=1, lazy_s=100.0))
    try:
        with pytest.raises(RunError, match="raised RuntimeError"):
            eng.run({}, RunOptions(timeout=30))
        ran = {vid for vid, *_ in eng.execs[0].trace}
        assert len(ran) == 30
        held = set(eng.sched.held_by(0))
        assert held == set(eng.execs[0].core.mine) - ran, f"held but done: {sorted(held & ran)}"
    finally:
        eng.close()
