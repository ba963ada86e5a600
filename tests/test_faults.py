"""Faults under the ray engine: a kernel that raises, a worker killed mid-run, bad inputs.

Each must stop the run within seconds with a RunError naming the worker (and the vertex where
known), never hang; `timeout=` below only turns a hang into a failure.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time

import pytest

import disco_ray
from disco_ray.driver.api import run_memgraph
from disco_ray.driver.program import Program
from disco_ray.graph.errors import RunError
from disco_ray.graph.reference import evaluate, random_inputs
from tests.runtime_helpers import noop_op, plan, random_taskgraph  # noqa: F401
from tests.test_runtime_local import assert_same, noop_graph

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray
NO_SHARED_RAY = True  # its first test starts Ray itself and checks that shutdown() stops it


@pytest.mark.slow
def test_runs_share_one_warm_pool_until_shutdown():
    """Runs first in this module, before the fixture starts a shared Ray: the first run starts Ray
    and the actors, the next run (another graph, another plan) reuses them, shutdown() ends both."""
    if ray.is_initialized():
        pytest.skip("a Ray session is already running")
    from disco_ray.driver import pool as pool_module

    tg = random_taskgraph(21, n=10, gpus=2)
    inputs = random_inputs(tg, 0)
    out = run_memgraph(tg, plan(tg, "tight"), inputs, engine="ray", num_cpus=2, timeout=120)
    assert_same(out, evaluate(tg, inputs))
    assert ray.is_initialized()
    shared = pool_module._SHARED
    assert shared is not None
    actors = [w._actor_id for w in shared.workers]
    tg2 = random_taskgraph(22, n=10, gpus=2)
    out = disco_ray.run(tg2, random_inputs(tg2, 1), engine="ray", timeout=120)
    assert_same(out, evaluate(tg2, random_inputs(tg2, 1)))
    assert [w._actor_id for w in shared.workers] == actors  # no new actor started
    disco_ray.shutdown()
    assert not ray.is_initialized() and pool_module._SHARED is None


from tests.ray_fixtures import pool  # noqa: E402, F401  (module fixture)


def test_kernel_that_raises_names_worker_and_vertex(pool, noop_op):  # noqa: F811
    tg = noop_graph(fail_at="n5", gpus=2, n=8)
    mg = plan(tg)
    vid = next(v.id for v in mg.vertices if v.value == "n5")
    t = time.monotonic()
    with (
        Program(tg, mg, engine="ray", pool=pool) as prog,
        pytest.raises(RunError, match=rf"gpu:1 vertex {vid} \(kernel 'n5'\) raised RuntimeError"),
    ):
        prog.run({}, timeout=60)
    assert time.monotonic() - t < 30


def test_killed_worker_stops_the_run_naming_it(pool, noop_op):  # noqa: F811
    tg = noop_graph(gpus=2, n=60)
    mg = plan(tg)
    with Program(tg, mg, engine="ray", pool=pool) as prog:
        victim = prog.engine.workers[1]
        timer = threading.Timer(0.5, ray.kill, [victim])
        timer.start()
        t = time.monotonic()
        try:
            with pytest.raises(RunError, match=r"gpu:1 worker.* died during the run while holding"):
                prog.run({}, delay=(0.02, 0.03), timeout=60)  # ~2 s of work: killed halfway
        finally:
            timer.join()
        assert time.monotonic() - t < 30


def test_the_pool_recovers_after_a_fault(pool):  # noqa: F811
    tg = random_taskgraph(22, n=20, gpus=2)
    inputs = random_inputs(tg, 0)
    with Program(tg, plan(tg, "tight"), engine="ray", pool=pool) as prog:
        assert_same(prog.run(inputs, check=True, timeout=120), evaluate(tg, inputs))


def test_bad_inputs_are_refused_before_anything_runs(pool):  # noqa: F811
    tg = random_taskgraph(23, n=10, gpus=2)
    prog = Program(tg, plan(tg), engine="ray", pool=pool)
    good = random_inputs(tg, 0)
    name = sorted(good)[0]
    with pytest.raises(RunError, match=f"input {name!r} is missing"):
        prog.run({k: v for k, v in good.items() if k != name})
    with pytest.raises(RunError, match=f"input {name!r} has shape"):
        prog.run({**good, name: good[name].T[:2]})
    with pytest.raises(RunError, match=f"input {name!r} has dtype"):
        prog.run({**good, name: good[name].half()})
    assert prog._engine is None


# ---- issue 15: a silent worker, a dead coordinator, a placement that can never be granted ---------
def test_stopped_worker_is_named_within_the_stall_bound(pool, noop_op):  # noqa: F811
    """SIGSTOP: the worker neither dies nor answers; the heartbeat names it (gpu, actor, pid)
    within the stall timeout plus a heartbeat, without any --timeout."""
    import os
    import signal

    tg = noop_graph(gpus=2, n=60)
    with Program(tg, plan(tg), engine="ray", pool=pool) as prog:
        prog.engine  # noqa: B018  (actors and their pids first)
        pid = pool.pids[2]  # [coordinator, gpu:0, gpu:1]
        timer = threading.Timer(0.5, os.kill, [pid, signal.SIGSTOP])
        timer.start()
        t = time.monotonic()
        try:
            with pytest.raises(
                RunError, match=rf"gpu:1 worker \(actor \w+, pid {pid}\).* has not answered for"
            ):
                prog.run({}, delay=(0.02, 0.03), stall_timeout=3.0)  # ~2 s of work, no timeout
        finally:
            timer.join()
            os.kill(pid, signal.SIGCONT)  # let Ray's kill (on close) finish it
        assert time.monotonic() - t < 3.0 + 8  # the bound: the stall timeout, a heartbeat, slack


def test_the_stall_timeout_is_10_s_by_default_and_checked():
    from actors.options import RunOptions
    from disco_ray.cli.app import build_parser

    assert RunOptions().stall_timeout == 10.0
    assert build_parser().parse_args(["run", "x", "--out", "o.npz"]).stall_timeout == 10.0
    for bad in (0, -1.0, float("nan"), float("inf"), "3"):
        with pytest.raises(RunError, match="stall_timeout must be"):
            RunOptions(stall_timeout=bad)


def test_a_silent_actor_is_named_the_stall_timeout_after_its_last_answer(monkeypatch):
    """The watchdog counts quiet from an actor's last answer: one stopped right after answering
    is named 10 s later (plus a poll), not 10 s after the next ping (a heartbeat more)."""
    from disco_ray.driver import watch

    clock = [0.0]
    answered: set[int] = set()
    sent: list[int] = []

    class Actor:
        class ping:  # the shape of a Ray actor method: ping.remote()
            @staticmethod
            def remote() -> int:
                sent.append(len(sent))
                return sent[-1]

    monkeypatch.setattr(watch.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: ([r for r in refs if r in answered], []))
    dog = watch.Watchdog({1: Actor()}, 1.0, 10.0)
    for t in (1.0, 1.2):  # ping 0 goes at 1.0, its answer is seen at 1.2
        clock[0] = t
        answered.add(0)
        assert dog.check() is None
    clock[0] = 2.0  # ping 1 goes: the actor was stopped after its answer and never answers
    assert dog.check() is None and sent == [0, 1]
    clock[0] = 11.1
    assert dog.check() is None
    clock[0] = 11.3
    key, quiet = dog.check()
    assert key == 1 and quiet == pytest.approx(10.1)


@pytest.mark.slow
def test_a_kernel_longer_than_the_stall_timeout_is_not_a_stall(pool, noop_op):  # noqa: F811
    """A worker busy in one 12 s kernel answers every heartbeat (pings run on another thread),
    so the default 10 s stall timeout never ends a healthy run."""
    from disco_ray.graph.taskgraph import TaskGraph

    tg = TaskGraph(gpus=2)
    a = tg.kernel("noop", gpu=0, id="a", shape=[4])
    tg.output(tg.kernel("noop", tg.transfer(a, gpu=1, id="t"), gpu=1, id="long", shape=[4], sleep=12.0))
    with Program(tg, plan(tg), engine="ray", pool=pool) as prog:
        t = time.monotonic()
        prog.run({})  # the default stall timeout (10 s), no timeout
        assert time.monotonic() - t >= 12.0


def test_killed_coordinator_stops_the_run_naming_it(pool, noop_op):  # noqa: F811
    tg = noop_graph(gpus=2, n=60)
    with Program(tg, plan(tg), engine="ray", pool=pool) as prog:
        timer = threading.Timer(0.5, ray.kill, [prog.engine.coord])
        timer.start()
        t = time.monotonic()
        try:
            with pytest.raises(RunError, match="coordinator"):
                prog.run({}, delay=(0.02, 0.03), timeout=60)
        finally:
            timer.join()
        assert time.monotonic() - t < 30


def test_a_coordinator_dead_before_the_run_starts_is_named(pool, noop_op):  # noqa: F811
    """Killed before `start` reaches it (the race of the test above when the kill lands early)."""
    tg = noop_graph(gpus=2, n=8)
    with Program(tg, plan(tg), engine="ray", pool=pool) as prog:
        ray.kill(prog.engine.coord)
        with pytest.raises(RunError, match=r"the coordinator .* died as the run started"):
            prog.run({}, timeout=60)


def test_a_placement_no_node_can_hold_is_refused_at_once(pool):  # noqa: F811
    from actors.coordinator import Coordinator
    from actors.worker import GpuWorker
    from disco_ray.driver.placement import PlacementConfig, place

    t = time.monotonic()
    with pytest.raises(RunError, match=r"can never place 2 workers of \{CPU: 1000.* need 2000 CPU, it has 2"):
        place(2, "cpu", PlacementConfig(cpus_per_worker=1000), GpuWorker, Coordinator)
    assert time.monotonic() - t < 5


def test_worker_stopped_before_the_run_starts_is_named(pool, noop_op):  # noqa: F811
    import os
    import signal

    tg = noop_graph(gpus=2, n=8)
    with Program(tg, plan(tg), engine="ray", pool=pool) as prog:
        prog.engine  # noqa: B018
        pid = pool.pids[1]  # gpu:0
        os.kill(pid, signal.SIGSTOP)
        t = time.monotonic()
        try:
            with pytest.raises(RunError, match=rf"gpu:0 worker \(actor \w+, pid {pid}\).* as the run starts"):
                prog.run({}, stall_timeout=3.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - t < 3.0 + 8


def test_a_full_disk_under_ray_names_the_spill_file_and_leaves_none(pool, tmp_path):  # noqa: F811
    """A worker's writes to its spill file fail (a file-size limit set in the worker after the
    file is preallocated: EFBIG, as ENOSPC on a full disk): the run ends naming the file, and the
    pool removes the files of the workers it kills."""
    from disco_ray.driver.api import compile
    from workloads import build

    def limit(worker, nbytes: int) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    w = build("llama_prefill", preset="tiny", layers=4, seq=256, tile=64)
    prog = compile(w.taskgraph, 200 << 10, host_capacity=0, engine="ray", pool=pool, disk_dir=str(tmp_path))
    with prog:
        ray.get([x.call.remote(limit, 1) for x in prog.engine.workers])  # after the files are made
        assert len(list(tmp_path.iterdir())) == 2
        with pytest.raises(
            RunError, match=rf"spill file {tmp_path}/spill-gpu\d-.*: a write failed: File too large"
        ):
            prog.run(w.inputs, timeout=120)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_worker_stopped_outside_a_run_is_named_not_waited_for(pool, noop_op):  # noqa: F811
    """Loading a graph and moving states are watched as runs are: a stopped worker is named
    after the default stall timeout (10 s), never a hang (a decode loop does both between runs)."""
    import os
    import signal

    def named(call) -> str:
        got: list = []
        t = threading.Thread(target=lambda: got.append(_raised(call)), daemon=True)
        t.start()
        t.join(timeout=60)
        for pid in pool.pids[1:]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)  # let Ray's kill finish it
        assert got, "still waiting 60 s after a worker stopped"
        return got[0]

    tg = noop_graph(gpus=2, n=8)
    pool.acquire(2, op_modules=["actors.testops"])
    os.kill(pool.pids[2], signal.SIGSTOP)
    prog = Program(tg, plan(tg), engine="ray", pool=pool)
    assert re.search(
        r"gpu:1 worker .* has not answered for 1\d s .*(installing its ops|loading the graph)",
        named(lambda: prog.engine),
    )
    pool.acquire(2, op_modules=["actors.testops"])
    os.kill(pool.pids[1], signal.SIGSTOP)
    assert re.search(
        r"gpu:0 worker \(pid \d+\) has not answered .*moving states", named(lambda: pool.move_states({}))
    )


def _raised(call) -> str:
    try:
        call()
    except RunError as e:
        return str(e)
    return "no error"
