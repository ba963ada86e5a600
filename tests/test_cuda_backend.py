"""The cuda backend's host side on the stand-in device (tests/fake_cuda.py): its threads, events,
lanes, pinned memory and failure paths, without a GPU.

What runs here is the backend's own code (loop, wakers, helpers, events, copies' lanes, memory
calls) with torch.cuda replaced by host objects: a vertex's work runs later, on its stream's
thread, on the CPU, and a range being written holds poison until then (tests/test_fake_cuda.py).
What it cannot show: device speed, and whether CUDA itself behaves as the stand-in says
(tests/test_gpu.py, benchmarks/gpu_session.sh).
"""

from __future__ import annotations

import collections
import gc
import threading
import time

import pytest
import torch

from actors import resources
from actors.backends import cuda_loop
from actors.backends.base import Mode
from actors.backends.cuda import CudaBackend
from actors.executor import Executor
from actors.options import RunOptions, WorkerConfig
from actors.transports.local import LocalTransport
from disco_ray.driver.engine_local import LocalEngine
from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MKind
from disco_ray.graph.reference import evaluate, random_inputs
from tests import fake_cuda
from tests.fake_cuda import FakeEvent, FakeStream, install
from tests.runtime_helpers import plan, random_taskgraph

WAIT_S = 20.0  # bounds every wait: a hang fails the test instead of hanging it


def _same(out, ref, what):
    assert set(out) == set(ref), what
    for k in ref:
        assert torch.allclose(out[k], ref[k], rtol=1e-4, atol=1e-4), f"output {k!r}, {what}"


def _run(ex: Executor, inputs, **kw) -> str | None:
    """One run of a single executor, bounded; returns its error (None: it succeeded)."""
    ex.begin(inputs, **kw)
    ex.dispatch(list(ex.core.mine))
    assert ex.wait(timeout=WAIT_S), "the run hung"
    return ex.error


# ---- the loop, wakers, events ------------------------------------------------------------------
@pytest.mark.parametrize(
    "ahead,device_s,streams", [(0, 0.0, 3), (4, 0.0, 3), (0, 2e-4, 3), (4, 2e-4, 3), (2, 2e-4, 1)]
)
def test_cuda_backend_loop_and_wakers_on_a_fake_device(monkeypatch, ahead, device_s, streams):
    """The loop and waker threads, event waits and shutdown: outputs match the reference, the loop
    launches in submission order, launch ahead waits on events, the loop sleeps while the device
    works and is woken, no waker spins (every event a waker sleeps on has the blocking-sync
    flag), nothing hangs."""
    install(monkeypatch.setattr)
    monkeypatch.setattr(FakeStream, "device_s", device_s)
    FakeStream.waited = []
    tg = random_taskgraph(404, n=60, gpus=1, size=16)
    mg = plan(tg, "tight")
    be = CudaBackend()
    ex = Executor(0, mg, tg, WorkerConfig(streams=streams, ahead=ahead), backend=be)
    loop = be.loop
    submitted, launched = [], []
    submit, launch = loop.submit, loop._launch
    monkeypatch.setattr(loop, "submit", lambda s, vid, *a: (submitted.append(vid), submit(s, vid, *a)))
    monkeypatch.setattr(loop, "_launch", lambda vid, *a: (launched.append(vid), launch(vid, *a))[1])
    try:
        for run in range(2):
            inputs = random_inputs(tg, run)
            assert _run(ex, inputs, delay=(0, 2e-4), seed=run) is None, ex.error
            out = {k: ex.output(k, mg.outputs[k]) for k in tg.outputs}
            _same(out, evaluate(tg, inputs), f"run {run} ahead {ahead}")
            assert all(t0 <= t1 for _, _, t0, t1 in ex.trace)
        assert launched == submitted and len(launched) == 2 * len(ex.core.mine)
        assert (ex.launched_ahead > 0) == (ahead > 0)
        host = ex.statistics()["backend"]["host"]
        assert host["launches"] == 2 * len(ex.core.mine) and host["launch_us_mean"] > 0, host
        assert host["blocking"] == 0
        assert (host["idle_s"] > 0) == (device_s > 0), host
        assert FakeEvent.spins == 0, "a waker busy-waited on an event without the blocking-sync flag"
        threads = be._threads
        total = ex.slots.total
        names = ["cuda-loop"] + [f"cuda-{k}-{s}" for k in ("wait", "blocking") for s in range(total)]
        assert [t.name for t in threads] == names
    finally:
        ex.close()
    assert not any(t.is_alive() for t in threads)


def test_events_carry_the_flags_their_use_needs(monkeypatch):
    """Vertex events: start timed, end timed and blocking-sync (wakers sleep on it); the clock's
    base timed and blocking-sync (synchronized when idle)."""
    install(monkeypatch.setattr)
    start, end = cuda_loop.new_events()
    assert (start.timing, start.blocking) == (True, False)
    assert (end.timing, end.blocking) == (True, True)
    clock = cuda_loop.Clock(FakeStream())
    assert clock.base.timing and clock.base.blocking
    marker = FakeEvent()  # what the NCCL channel makes for ordering only: no timing to pay for
    with pytest.raises(RuntimeError, match="enable_timing"):
        marker.elapsed_time(end)


def test_fake_device_loop_is_woken_by_the_same_vertex_twice(monkeypatch):
    """A vertex's events come back in the next run: the loop must arm its waker with them again."""
    install(monkeypatch.setattr)
    monkeypatch.setattr(FakeStream, "device_s", 2e-3)
    be = CudaBackend()
    finished = threading.Semaphore(0)
    be.open(1, lambda vid, s: None, lambda *a: finished.release())
    try:
        for run in range(3):
            be.submit(0, 7)
            assert finished.acquire(timeout=10), f"run {run}: the loop was never woken"
        assert be.statistics()["host"]["idle_s"] > 0
    finally:
        be.close()


def test_a_lost_wake_up_costs_a_moment_not_the_run(monkeypatch):
    """Wakers that never wake the loop (lost wake-ups): the loop still finds the completions,
    since it never sleeps longer than WAKE_S."""
    install(monkeypatch.setattr)
    monkeypatch.setattr(FakeStream, "device_s", 2e-3)
    monkeypatch.setattr(cuda_loop, "WAKE_S", 0.01)
    monkeypatch.setattr(cuda_loop.CudaLoop, "_waker", lambda self, s: None)  # no waker at all
    tg = random_taskgraph(31, n=20, gpus=1, size=8)
    mg = plan(tg, "roomy")
    ex = Executor(0, mg, tg, WorkerConfig(streams=2), backend=CudaBackend())
    try:
        inputs = random_inputs(tg, 0)
        assert _run(ex, inputs) is None, ex.error
        _same({k: ex.output(k, mg.outputs[k]) for k in tg.outputs}, evaluate(tg, inputs), "no wakers")
    finally:
        ex.close()


# ---- failures never hang -----------------------------------------------------------------------
def test_a_failing_launch_loop_fails_the_run_instead_of_hanging(monkeypatch):
    """An error of the loop outside any vertex (here: re-reading the device clock) ends the run
    with an error naming the loop; nothing hangs."""
    install(monkeypatch.setattr)
    tg = random_taskgraph(7, n=20, gpus=1, size=16)
    mg = plan(tg, "roomy")
    ex = Executor(0, mg, tg, WorkerConfig(streams=2), backend=CudaBackend())

    def broken(self, every_s=0.5):
        raise RuntimeError("device clock unreadable")

    monkeypatch.setattr(cuda_loop.Clock, "rebase", broken)
    try:
        err = _run(ex, random_inputs(tg, 0))
        assert err is not None and "launch loop failed" in err and "device clock unreadable" in err, err
    finally:
        ex.close()


def test_each_vertex_ends_once_when_the_loop_fails_mid_pass(monkeypatch):
    """The loop fails in the middle of a pass that already launched some vertices: every vertex
    it holds ends with the error exactly once (before, those launched in that pass ended twice:
    once as launched, once as still waiting)."""
    install(monkeypatch.setattr)
    tg = random_taskgraph(8, n=40, gpus=1, size=8)
    mg = plan(tg, "roomy")
    be = CudaBackend()
    ex = Executor(0, mg, tg, WorkerConfig(streams=3), backend=be)
    ends = collections.Counter()
    done = ex._done

    def counting(vid, *a):
        ends[vid] += 1
        done(vid, *a)

    be.loop.done = counting
    launch = be.loop._launch
    n = {"launches": 0}

    def third_fails(vid, s, waits):
        n["launches"] += 1
        if n["launches"] == 3:
            raise RuntimeError("a bug in the launch path")
        return launch(vid, s, waits)

    monkeypatch.setattr(be.loop, "_launch", third_fails)
    try:
        err = _run(ex, random_inputs(tg, 0))
        assert err is not None and "a bug in the launch path" in err, err
        twice = {v: c for v, c in ends.items() if c > 1}
        assert not twice, f"vertices ended more than once: {twice}"
    finally:
        ex.close()


@pytest.mark.parametrize("blocking", [False, True])
def test_an_end_event_that_cannot_be_recorded_fails_the_vertex(monkeypatch, blocking):
    """A sticky CUDA error when recording a vertex's end event, on the loop or in a helper thread
    (a blocking transfer): the run ends with that error, naming the vertex; no thread dies
    holding its stream (before, the helper died and the run hung)."""
    install(monkeypatch.setattr)
    tg = random_taskgraph(9, n=40, gpus=2, size=8)
    mg = plan(tg, "roomy")
    kind = MKind.TRANSFER if blocking else MKind.KERNEL
    victim = next(v for v in mg.vertices if v.kind is kind and v.gpu == 1)

    class Sticky(FakeEvent):
        def record(self, stream=None):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    real = cuda_loop.new_events
    made = {}

    def events_of(self, vid):
        if vid not in self.events:
            self.events[vid] = (real()[0], Sticky(True, True)) if vid == victim.id else real()
            made[vid] = True
        return self.events[vid]

    monkeypatch.setattr(cuda_loop.CudaLoop, "_events_of", events_of)
    monkeypatch.setattr(resources, "make_backend", lambda name, device=None: CudaBackend())
    if blocking:
        monkeypatch.setattr(LocalTransport, "mode", lambda self, src: Mode.BLOCKING)  # a helper runs it
    eng = LocalEngine(tg, mg, config=WorkerConfig(backend="cuda", streams=2))
    try:
        with pytest.raises(RunError, match="illegal memory access") as err:
            eng.run(random_inputs(tg, 0), RunOptions(timeout=WAIT_S))
        assert f"vertex {victim.id}" in str(err.value), err.value
        assert victim.id in made
    finally:
        eng.close()


def test_a_loop_that_cannot_start_fails_open(monkeypatch):
    """What the loop needs (device, warm-up, the clock) is made before `open` returns: an error
    there fails `open` (before, the clock was made after: its error killed the loop unseen, and
    every run hung)."""
    install(monkeypatch.setattr)

    def no_clock(self, stream):
        raise RuntimeError("cudaEventCreate failed")

    monkeypatch.setattr(cuda_loop.Clock, "__init__", no_clock)
    be = CudaBackend()
    with pytest.raises(RunError, match="cudaEventCreate failed"):
        be.open(2, lambda vid, s: None, lambda *a: None)
    be.close()


# ---- copies on their lanes ----------------------------------------------------------------------
def test_loads_offloads_and_transfers_run_on_their_lanes(monkeypatch):
    """Kernels on the compute streams; inputs and reloads on the H2D lane, offloads on the D2H
    lane, transfers on the lane of their source GPU; outputs as the reference."""
    install(monkeypatch.setattr)
    monkeypatch.setattr(resources, "make_backend", lambda name, device=None: CudaBackend())
    tg = random_taskgraph(41, n=80, gpus=3, size=16)
    mg = plan(tg, "tight")
    eng = LocalEngine(tg, mg, config=WorkerConfig(backend="cuda", streams=2))
    try:
        inputs = random_inputs(tg, 0)
        out, traces = eng.run(inputs, RunOptions(timeout=WAIT_S))
        _same(out, evaluate(tg, inputs), "lanes")
        for g, ex in enumerate(eng.execs):
            for vid, s, *_ in traces[g]:
                v = mg.vertex(vid)
                want = {
                    MKind.KERNEL: range(2),
                    MKind.INPUT: [ex.h2d],
                    MKind.RELOAD: [ex.h2d],
                    MKind.OFFLOAD: [ex.d2h],
                }.get(v.kind) or [ex.peer_lane[v.ins[0].loc.device]]
                assert s in want, (g, vid, v.kind, s)
        kinds = {mg.vertex(vid).kind for tr in traces for vid, *_ in tr}
        assert {MKind.OFFLOAD, MKind.RELOAD, MKind.TRANSFER} <= kinds
    finally:
        eng.close()


@pytest.mark.parametrize("seed,check", [(0, False), (1, False), (2, True)])
def test_blocking_transfers_run_beside_the_loop_on_a_fake_device(monkeypatch, seed, check):
    """Transfers whose pull waits on the host run in helper threads while the loop holds their
    lane: the other streams go on, and nothing queued behind them (launch ahead; off under the
    sanitizer, which checks every read) starts early: the outputs match the reference."""
    install(monkeypatch.setattr)
    monkeypatch.setattr(resources, "make_backend", lambda name, device=None: CudaBackend())
    helpers = set()
    pull = LocalTransport.pull

    def slow_pull(self, *a):  # a pull that waits on the host, like a Ray call
        helpers.add(threading.current_thread().name)
        time.sleep(1e-3)
        pull(self, *a)

    monkeypatch.setattr(LocalTransport, "pull", slow_pull)
    monkeypatch.setattr(LocalTransport, "mode", lambda self, src: Mode.BLOCKING)
    tg = random_taskgraph(seed, n=80, gpus=3, size=16)
    mg = plan(tg, "tight")
    eng = LocalEngine(tg, mg, config=WorkerConfig(backend="cuda", streams=2))
    try:
        inputs = random_inputs(tg, seed)
        out, _ = eng.run(inputs, RunOptions(check=check, delay=(0, 2e-4), seed=seed))
        _same(out, evaluate(tg, inputs), f"seed {seed}")
        blocking = sum(w["backend"]["host"]["blocking"] for w in eng.statistics()["workers"])
        transfers = sum(1 for v in mg.vertices if v.kind.value == "transfer")
        assert blocking == transfers > 0
        assert helpers and all(n.startswith("cuda-blocking") for n in helpers), helpers
    finally:
        eng.close()


# ---- memory ------------------------------------------------------------------------------------
def test_host_buffers_are_pinned_once_at_their_exact_size(monkeypatch):
    """The host store, the staging buffer of the caller's inputs and the states are registered
    with cudaHostRegister at exactly their size, never through torch's caching host allocator
    (which pins the next power of two), and unregistered when freed."""
    from actors.tiers.store import WorkerStore

    fake = install(monkeypatch.setattr)
    g = random_taskgraph(51, n=30, gpus=1, size=24)  # 24x24 float32: 2304 bytes, not a power of two
    mg = plan(g, "tight")
    be = CudaBackend()
    store = WorkerStore(0, be.alloc, True)
    ex = Executor(0, mg, g, WorkerConfig(streams=2), backend=be, store=store)
    try:
        assert fake_cuda.PINNED_BLOCKS == [], "host memory pinned through torch's caching allocator"
        sizes = sorted(fake.cudart.registered.values())
        want = sorted(n for n in (ex.host.numel(), ex.staging.numel()) if n)
        assert sizes == want, (sizes, want)
        assert be.statistics()["pinned"] == sum(want)
        assert ex.staging.numel() == sum(-(-g[x].nbytes // 256) * 256 for x in ex.input_values)
    finally:
        ex.close()
    del ex, store
    gc.collect()
    assert fake.cudart.registered == {}, "pinned host memory outlived its buffer"


def test_kernel_temporaries_are_reserved_on_the_compute_streams(monkeypatch):
    """Each compute stream keeps the largest temporaries of the graph's kernels ready (attention
    here); the copy lanes reserve nothing."""
    from disco_ray.graph.kernels import temp_bytes
    from workloads.llama import llama_prefill

    fake = install(monkeypatch.setattr)
    w = llama_prefill(preset="tiny", layers=1, gpus=1, seq=64, tile=16)
    tg = w.taskgraph
    mg = plan(tg, "roomy")
    be = CudaBackend(workspace=0)
    ex = Executor(0, mg, tg, WorkerConfig(streams=3), backend=be)
    try:
        need = max(temp_bytes(p.op, p.out, p.ins, p.attrs) for p in ex.plans.values() if p.op)
        attention = max(
            temp_bytes(p.op, p.out, p.ins, p.attrs) for p in ex.plans.values() if p.op == "attention"
        )
        assert need == attention > 0 and ex.workspace == need
        reserved = {id(s): n for s, n in fake.reserved}
        assert set(reserved) == {id(s) for s in be.streams[:3]}, "lanes reserved kernel memory"
        assert all(n >= need for n in reserved.values())
        assert _run(ex, w.inputs) is None, ex.error
    finally:
        ex.close()


@pytest.mark.parametrize("device,held", [("strict", False), ("null", False), ("null", True)])
def test_bench_host_runs_the_llama_structure_on_the_stand_in_device(monkeypatch, capsys, device, held):
    """benchmarks/bench_host.py: llama_prefill's 7B vertex structure on the loop, outputs checked,
    on the strict stand-in and on the null device (benchmarks/null_cuda.py); `--held`: after the
    first run only the activations are handed in, and the other 52 loads are skipped."""
    import importlib.util
    import pathlib
    from types import SimpleNamespace

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_host.py"
    spec = importlib.util.spec_from_file_location("bench_host", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    null = mod._null_cuda()  # takes the stand-in's own `install`, before it is wrapped below
    monkeypatch.setattr(fake_cuda, "install", lambda: install(monkeypatch.setattr))  # undone after
    monkeypatch.setattr(
        mod, "_null_cuda", lambda: SimpleNamespace(install=lambda: null.install(monkeypatch.setattr))
    )
    args = ["--repeat", "1", "--streams", "2", "--ahead", "4", "--device", device] + ["--held"] * held
    assert mod.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("llama_prefill structure: 572 vertices")
    assert lines[-1].split()[:2] == ["2", "4"]
    assert lines[-1].split()[-1] == ("52" if held else "0")  # loads skipped in the last run
