"""A one-worker run on the ray engine: one call per run (`GpuWorker.run_alone`), no coordinator.

The coordinator's parts are kept without it: results under random orders and the sanitizer,
inputs left out after the first run, a kernel that raises, a killed worker named with what it
held (the driver polls its completions), a stopped one named within the stall bound, the
timeout and the progress callback. Plus the per-plan launch tables (`Executor._lanes`).
"""

from __future__ import annotations

import threading
import time

import pytest

from actors.lanes import Lanes
from disco_ray.driver.program import Program
from disco_ray.graph.errors import RunError
from disco_ray.graph.reference import evaluate, random_inputs
from tests.ray_fixtures import pool  # noqa: F401  (module fixture)
from tests.runtime_helpers import MODES, noop_op, plan, random_taskgraph  # noqa: F401
from tests.test_runtime_local import assert_same, noop_graph

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.mark.parametrize("mode", MODES)
def test_one_worker_runs_match_reference_without_the_coordinator(pool, mode):  # noqa: F811
    """Random orders, the sanitizer, inputs left out in later runs (the worker's copy), small
    inputs of several dtypes shipped as numpy bytes; the worker sends no report at all."""
    for seed, dtype in ((0, "float32"), (1, "bfloat16")):
        tg = random_taskgraph(300 + seed, n=30, gpus=1, dtype=dtype)
        with Program(tg, plan(tg, mode), engine="ray", pool=pool, streams=3) as prog:
            first = random_inputs(tg, 0)
            for run in range(3):
                inputs = first if run == 0 else {}  # later runs: the worker's copy
                out = prog.run(inputs, check=True, delay=(0, 1e-3), seed=run, timeout=120)
                assert_same(out, evaluate(tg, first), (seed, run))
            stats = prog.statistics()["engine"]
            assert stats["scheduler"]["coordinator"] is False
            assert stats["scheduler"]["dispatch_messages"] == stats["scheduler"]["cross_worker_edges"] == 0
            assert stats["scheduler"]["state"] == "finished"
            assert stats["scheduler"]["completed"] == len(prog.mg)
            assert stats["workers"][0]["reports"] == 0  # not one message to the coordinator
            assert prog.last_summary is not None and prog.last_summary["vertices"] == len(prog.mg)


def test_one_worker_kernel_that_raises_names_worker_and_vertex(pool, noop_op):  # noqa: F811
    tg = noop_graph(fail_at="n5", gpus=1, n=8)
    mg = plan(tg)
    vid = next(v.id for v in mg.vertices if v.value == "n5")
    with (
        Program(tg, mg, engine="ray", pool=pool) as prog,
        pytest.raises(RunError, match=rf"gpu:0 vertex {vid} \(kernel 'n5'\) raised RuntimeError"),
    ):
        prog.run({}, timeout=60)
    tg = noop_graph(gpus=1, n=8)  # the pool recovers: the next run on it is right
    with Program(tg, plan(tg), engine="ray", pool=pool) as prog:
        assert sorted(prog.run({}, timeout=60)) == ["n7"]


def test_one_worker_progress_and_timeout(pool, noop_op):  # noqa: F811
    tg = noop_graph(gpus=1, n=40)
    seen: list[int] = []
    with Program(tg, plan(tg), engine="ray", pool=pool) as prog:
        prog.run({}, delay=(0.02, 0.03), progress=seen.append, timeout=60)  # ~1 s: several polls
        assert seen[-1] == len(prog.mg) and seen == sorted(seen)
        assert any(0 < n < len(prog.mg) for n in seen), seen  # polled during the run
        with pytest.raises(RunError, match=r"run did not finish within 0.5 s \((\d+) of \d+ vertices done\)"):
            prog.run({}, delay=(0.02, 0.03), timeout=0.5)


def test_one_worker_killed_is_named_with_what_it_held(pool, noop_op):  # noqa: F811
    """No coordinator counted the run: the held vertices are those the driver's last poll had not
    seen done, so fewer than all once some completed."""
    tg = noop_graph(gpus=1, n=60)
    with Program(tg, plan(tg), engine="ray", pool=pool) as prog:
        victim = prog.engine.workers[0]
        timer = threading.Timer(0.8, ray.kill, [victim])
        timer.start()
        t = time.monotonic()
        try:
            with pytest.raises(RunError, match=r"gpu:0 worker.* died during the run while holding") as e:
                prog.run({}, delay=(0.02, 0.03), timeout=60)  # ~1.5 s of work: killed halfway
        finally:
            timer.join()
        assert time.monotonic() - t < 30
        held = int(str(e.value).split("holding ")[1].split()[0])
        assert 0 < held < len(prog.mg), str(e.value)


def test_one_worker_stopped_is_named_within_the_stall_bound(pool, noop_op):  # noqa: F811
    import os
    import signal

    tg = noop_graph(gpus=1, n=60)
    with Program(tg, plan(tg), engine="ray", pool=pool) as prog:
        prog.engine  # noqa: B018  (actors and their pids first)
        pid = pool.pids[1]  # [coordinator, gpu:0, ...]
        timer = threading.Timer(0.5, os.kill, [pid, signal.SIGSTOP])
        timer.start()
        t = time.monotonic()
        try:
            with pytest.raises(
                RunError, match=rf"gpu:0 worker \(actor \w+, pid {pid}\).* has not answered for"
            ):
                prog.run({}, delay=(0.02, 0.03), stall_timeout=3.0)  # ~1.5 s of work, no timeout
        finally:
            timer.join()
            os.kill(pid, signal.SIGCONT)  # let Ray's kill (on close) finish it
        assert time.monotonic() - t < 3.0 + 8


def test_lane_tables_are_made_once_per_plan(monkeypatch):
    """The lanes of every copy are a table per plan: later runs do not walk the vertices again."""
    calls = []
    assign = Lanes.assign
    monkeypatch.setattr(Lanes, "assign", lambda self, *a: calls.append(1) or assign(self, *a))
    tg = random_taskgraph(310, n=20, gpus=2)
    inputs = random_inputs(tg, 0)
    with Program(tg, plan(tg, "tight"), engine="local") as prog:
        for _ in range(3):
            assert_same(prog.run(inputs, timeout=60), evaluate(tg, inputs))
    assert len(calls) == 2  # one per worker, at its first run
