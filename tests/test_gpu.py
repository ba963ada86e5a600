"""The cuda backend and its transports on a real GPU (marked `gpu`, skipped without CUDA).

Several Ray workers share the one GPU (fractional num_gpus), each with its own arena, so the
multi-GPU logic (transfers between arenas over CUDA IPC) runs on a single device. The path
choice is pure and also tested without a GPU.
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest
import torch

from actors.transport_cuda import choose_path, choose_paths
from disco_ray.reference import evaluate, random_inputs
from disco_ray.runtime import Program
from tests.runtime_helpers import plan, random_taskgraph

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _same(out, ref, what):
    assert set(out) == set(ref), what
    for k in ref:
        tol = 1e-4 if ref[k].dtype == torch.float32 else 3e-2
        assert out[k].dtype == ref[k].dtype, (k, what)
        got, want = out[k].float(), ref[k].float()
        assert torch.isfinite(got).all(), f"output {k!r} not finite, {what}"
        assert torch.allclose(got, want, atol=tol, rtol=tol), (
            f"output {k!r}, {what}: max abs err {(got - want).abs().max().item():.3g}"
        )


@pytest.fixture(autouse=True)
def _exact_fp32():
    if CUDA:  # the reference runs on the CPU in true fp32: no TF32 on the GPU either
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        yield
        torch.backends.cuda.matmul.allow_tf32 = old
    else:
        yield


# ---- path choice (pure: runs everywhere) --------------------------------------------------------
def _info(node="n0", uuid="GPU-0", ipc=True, nccl=True):
    return {"node": node, "uuid": uuid, "ipc": ipc, "nccl": nccl}


def test_path_choice():
    assert choose_path(_info(), _info()) == "ipc"  # workers sharing one GPU
    assert choose_path(_info(), _info(ipc=False)) == "ray"  # same GPU: NCCL refuses two ranks there
    assert choose_path(_info(), _info(uuid="GPU-1")) == "nccl"  # two GPUs of one node
    assert choose_path(_info(), _info(node="n1", uuid="GPU-1")) == "nccl"  # two nodes
    assert choose_path(_info(), _info(uuid="GPU-1", nccl=False)) == "ray"  # no cupy on one side
    assert choose_path(_info(), _info(), allow=("ray",)) == "ray"
    infos = [_info(), _info(), _info(uuid="GPU-1")]
    assert choose_paths(infos) == {(0, 1): "ipc", (0, 2): "nccl", (1, 2): "nccl"}


def test_lane_turns_follow_submission_order():
    import random
    import threading

    from actors.backend_cuda import Turns

    turns = Turns()
    tickets = [turns.take() for _ in range(40)]
    rng = random.Random(5)
    entered: list[int] = []
    lock = threading.Lock()

    def vertex(t: int) -> None:  # threads start in a shuffled order; half of them use a lane
        if t % 2 == 0:
            assert turns.wait(t, timeout=10), f"ticket {t} waited for ever"
            with lock:
                entered.append(t)
        turns.resolve(t)

    order = tickets[:]
    rng.shuffle(order)
    threads = [threading.Thread(target=vertex, args=(t,)) for t in order]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=20)
    assert entered == [t for t in tickets if t % 2 == 0], "seed 5"


# ---- the cuda backend's threads on a fake device (runs everywhere) ------------------------------
class _FakeEvent:
    """Host-side stand-in for torch.cuda.Event: work runs synchronously at launch, so an event is
    complete once recorded."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        assert self.t is not None, "waited on an event never recorded"

    def elapsed_time(self, end):
        if self.t is None or end.t is None:
            raise RuntimeError("event not recorded")
        return (end.t - self.t) * 1e3


class _FakeStream:
    waited: list = []

    def __init__(self, device=None):
        pass

    def wait_event(self, ev):
        assert ev.t is not None, "a stream waited on an event its launcher had not recorded"
        _FakeStream.waited.append(ev)

    def wait_stream(self, other):
        pass


def _fake_torch():
    cuda = SimpleNamespace(
        is_available=lambda: True,
        current_device=lambda: 0,
        set_device=lambda d: None,
        synchronize=lambda d=None: None,
        device=lambda d: contextlib.nullcontext(),
        stream=lambda s: contextlib.nullcontext(),
        current_stream=lambda: _FakeStream(),
        Stream=_FakeStream,
        Event=_FakeEvent,
    )
    return SimpleNamespace(
        cuda=cuda,
        device=lambda *a: torch.device("cpu"),
        empty=lambda n, dtype, device=None, pin_memory=False: torch.zeros(n, dtype=dtype),
        uint8=torch.uint8,
    )


@pytest.mark.parametrize("ahead", [0, 4])
def test_cuda_backend_launcher_and_waiter_threads_on_a_fake_device(monkeypatch, ahead):
    """The cuda backend's launch/wait threads, tickets, event waits and shutdown, with torch.cuda
    replaced by host stand-ins (kernels run on the CPU at launch): outputs match the reference,
    launch ahead waits on events, and nothing hangs."""
    from actors import backend_cuda
    from actors.executor import Executor, WorkerConfig

    monkeypatch.setattr(backend_cuda, "torch", _fake_torch())
    monkeypatch.setattr(backend_cuda, "_warm", lambda *a: None)
    _FakeStream.waited = []
    tg = random_taskgraph(404, n=60, gpus=1, size=16)
    mg = plan(tg, "tight")
    ex = Executor(0, mg, tg, WorkerConfig(streams=3, ahead=ahead), backend=backend_cuda.CudaBackend())
    try:
        for run in range(2):
            inputs = random_inputs(tg, run)
            ex.begin(inputs, delay=(0, 2e-4), seed=run)
            ex.dispatch(list(ex.core.mine))
            assert ex.wait(timeout=60), "the run hung"
            assert ex.error is None, ex.error
            out = {k: ex.output(k, mg.outputs[k]) for k in tg.outputs}
            _same(out, evaluate(tg, inputs), f"run {run} ahead {ahead}")
            assert all(t0 <= t1 for _, _, t0, t1 in ex.trace)
        assert (ex.launched_ahead > 0) == (ahead > 0)
        assert bool(_FakeStream.waited) == (ahead > 0)
        host = ex.statistics()["backend"]["host"]
        assert host["launches"] == 2 * len(ex.core.mine) and host["launch_us_mean"] > 0, host
        threads = list(ex.backend._threads)
        assert len(threads) == 6  # a launcher and a waiter per stream
    finally:
        ex.close()
    assert not any(t.is_alive() for t in threads)


# ---- local engine: one process, every worker's arena on the GPU ---------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["roomy", "tight"])
def test_local_engine_matches_reference(seed, mode):
    tg = random_taskgraph(300 + seed, n=40, gpus=1 + seed % 3, size=32)
    mg = plan(tg, mode)
    with Program(tg, mg, engine="local", backend="cuda", streams=3) as prog:
        for run in range(2):
            inputs = random_inputs(tg, run)
            out = prog.run(inputs, check=True, delay=(0, 2e-4) if run else None, seed=run, timeout=120)
            _same(out, evaluate(tg, inputs), f"seed {seed} run {run} mode {mode}")
        assert prog.last_summary["vertices"] == len(mg)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("ahead", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_launch_ahead_on_cuda_matches_reference(seed, ahead):
    """Kernels launched behind running predecessors (the stream waits on their events), on tight
    plans whose ranges are reused at once: a missing wait shows as a wrong output. The sanitizer
    is off (it turns launch ahead off on cuda), so the outputs are the check."""
    tg = random_taskgraph(500 + seed, n=60, gpus=1 + seed % 2, size=64)
    mg = plan(tg, "tight")
    with Program(tg, mg, engine="local", backend="cuda", streams=3, ahead=ahead) as prog:
        for run in range(3):
            inputs = random_inputs(tg, run)
            out = prog.run(inputs, delay=(0, 1e-4) if run == 2 else None, seed=run, timeout=120)
            _same(out, evaluate(tg, inputs), f"seed {seed} run {run} ahead {ahead}")
        assert sum(ex.launched_ahead for ex in prog.engine.execs) > 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_local(dtype):
    tg = random_taskgraph(17, n=30, gpus=2, dtype=dtype, size=32)
    inputs = random_inputs(tg, 1)
    with Program(tg, plan(tg, "tight"), engine="local", backend="cuda") as prog:
        _same(prog.run(inputs, check=True, timeout=120), evaluate(tg, inputs), dtype)


@pytest.mark.gpu
@needs_cuda
def test_no_device_allocation_while_graphs_run():
    tg = random_taskgraph(21, n=40, gpus=2, size=64)
    with Program(tg, plan(tg, "tight"), engine="local", backend="cuda", streams=3) as prog:
        assert prog.engine is not None  # arenas, streams and per-stream workspaces are made here
        torch.cuda.synchronize()
        segments = [torch.cuda.memory_stats()["segment.all.allocated"]]
        for run in range(3):
            inputs = random_inputs(tg, run)
            out = prog.run(inputs, delay=(0, 2e-4) if run else None, seed=run, timeout=120)
            segments.append(torch.cuda.memory_stats()["segment.all.allocated"])
            _same(out, evaluate(tg, inputs), f"run {run}")
    assert segments == segments[:1] * 4, f"cudaMalloc calls: {segments} (before, after each run)"


@pytest.mark.gpu
@needs_cuda
def test_inputs_are_staged_in_pinned_memory():
    from actors.executor import Executor, WorkerConfig

    tg = random_taskgraph(22, n=20, gpus=1, size=32)
    mg = plan(tg, "tight")
    ex = Executor(0, mg, tg, WorkerConfig("cuda", streams=2))
    try:
        assert ex.staging is not None and ex.staging.is_pinned()
        assert ex.host.numel() == 0 or ex.host.is_pinned()
        assert ex.arena.is_cuda
        ex.begin(random_inputs(tg, 0))
        assert all(t.is_pinned() for t in ex._inputs.values())
    finally:
        ex.close()


# ---- ray engine: 2-4 workers sharing the GPU, transfers over CUDA IPC ----------------------------
@pytest.fixture(scope="module")
def gpu_pool():
    if not CUDA:
        pytest.skip("needs CUDA")
    ray = pytest.importorskip("ray")
    from disco_ray.engine_ray import RayPool

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8, num_gpus=1, include_dashboard=False, logging_level="WARNING")
    p = RayPool()
    yield p
    p.discard()
    if started:
        ray.shutdown()


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_ray_workers_sharing_the_gpu_match_reference(gpu_pool, gpus):
    pool = gpu_pool
    pool.discard()  # a fresh pool per size: each worker asks for 1/gpus of the one GPU
    for seed in range(2):
        tg = random_taskgraph(400 + 10 * gpus + seed, n=50, gpus=gpus, size=32)
        mg = plan(tg, "tight")
        with Program(tg, mg, engine="ray", backend="cuda", pool=pool, streams=3) as prog:
            for run in range(2):
                inputs = random_inputs(tg, run)
                out = prog.run(inputs, check=True, delay=(0, 5e-4) if run else None, seed=run, timeout=180)
                _same(out, evaluate(tg, inputs), f"gpus {gpus} seed {seed} run {run}")
            summary = prog.last_summary
            stats = prog.statistics()["engine"]["workers"]
        assert summary["transports"] == {
            f"{i}-{j}": "ipc" for i in range(gpus) for j in range(i + 1, gpus)
        }, summary["transports"]
        if any(v.kind.value == "transfer" for v in mg.vertices):
            assert sum(w["transport"]["pulls"]["ipc"] for w in stats) > 0
            assert sum(w["transport"]["pulls"]["ray"] for w in stats) == 0


@pytest.mark.gpu
@pytest.mark.ray
def test_ray_fallback_path_on_cuda(gpu_pool, monkeypatch):
    monkeypatch.setenv("DISCO_CUDA_PATHS", "ray")  # read by the driver: no IPC, no NCCL
    gpu_pool.discard()
    tg = random_taskgraph(431, n=40, gpus=2, size=32)
    inputs = random_inputs(tg, 0)
    with Program(tg, plan(tg, "tight"), engine="ray", backend="cuda", pool=gpu_pool) as prog:
        _same(prog.run(inputs, check=True, timeout=180), evaluate(tg, inputs), "ray fallback")
        assert set(prog.last_summary["transports"].values()) == {"ray"}


@pytest.mark.gpu
@pytest.mark.ray
def test_sanitizer_fires_on_cuda(gpu_pool):
    import dataclasses

    from disco_ray.errors import RunError
    from disco_ray.memgraph import MKind, Read

    tg = random_taskgraph(432, n=30, gpus=2, size=32)
    mg = plan(tg, "tight")
    # a kernel claims its first operand was written by another vertex of its GPU
    for n, v in enumerate(mg.vertices):
        if v.kind is MKind.KERNEL and v.ins[0].src is not None:
            other = next(u.id for u in mg.vertices if u.gpu == v.gpu and u.id != v.ins[0].src)
            vs = list(mg.vertices)
            vs[n] = dataclasses.replace(v, ins=(Read(v.ins[0].value, other, v.ins[0].loc), *v.ins[1:]))
            bad = dataclasses.replace(mg, vertices=vs, _index=None)
            break
    with (
        Program(tg, bad, engine="ray", backend="cuda", pool=gpu_pool) as prog,
        pytest.raises(RunError, match=f"vertex {v.id}"),
    ):
        prog.run(random_inputs(tg, 0), check=True, timeout=180)


# ---- NCCL: one rank, to itself (two ranks on one GPU are refused by NCCL) -------------------------
@pytest.mark.gpu
@needs_cuda
def test_nccl_send_recv_helpers_on_one_rank():
    from actors.transport_cuda import nccl_available, nccl_recv, nccl_send

    if not nccl_available():
        pytest.skip("no cupy NCCL here")
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    try:
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        st = torch.cuda.Stream()
        torch.cuda.synchronize()
        nccl.groupStart()  # a rank's send to itself must be grouped with its recv
        nccl_send(comm, src, 0, st)
        nccl_recv(comm, dst, 0, st)
        nccl.groupEnd()
        st.synchronize()
        assert torch.equal(src, dst)
    finally:
        comm.destroy()


def test_cuda_backend_refused_without_cuda():
    if CUDA:
        pytest.skip("CUDA present")
    from actors.backend import make_backend
    from disco_ray.errors import RunError

    with pytest.raises(RunError, match="no CUDA device"):
        make_backend("cuda")
