"""The cuda backend and its transports on a real GPU (marked `gpu`, skipped without CUDA).

Several Ray workers share the one GPU (fractional num_gpus), each with its own arena, so the
multi-GPU logic (transfers between arenas over CUDA IPC) runs on a single device. The path
choice is pure and also tested without a GPU.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from actors.transport_cuda import choose_path, choose_paths
from disco_ray.driver.program import Program
from disco_ray.graph.reference import evaluate, random_inputs
from tests.fake_cuda import FakeStream, install
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


# ---- the cuda backend's threads on a stand-in device (tests/fake_cuda.py; runs everywhere) -------
@pytest.mark.parametrize(
    "ahead,device_s,streams", [(0, 0.0, 3), (4, 0.0, 3), (0, 2e-4, 3), (4, 2e-4, 3), (2, 2e-4, 1)]
)
def test_cuda_backend_loop_and_wakers_on_a_fake_device(monkeypatch, ahead, device_s, streams):
    """The cuda backend's loop and waker threads, event waits and shutdown, with torch.cuda
    replaced by host stand-ins (kernels run on the CPU at launch, events complete `device_s`
    later): outputs match the reference, the loop launches in submission order, launch ahead
    waits on events, the loop sleeps while the device works and is woken, nothing hangs."""
    from actors import backend_cuda
    from actors.executor import Executor, WorkerConfig

    install(monkeypatch.setattr)
    monkeypatch.setattr(FakeStream, "device_s", device_s)
    FakeStream.waited = []
    tg = random_taskgraph(404, n=60, gpus=1, size=16)
    mg = plan(tg, "tight")
    be = backend_cuda.CudaBackend()
    submitted, launched = [], []
    submit, launch = be.submit, be._launch
    monkeypatch.setattr(be, "submit", lambda s, vid, *a: (submitted.append(vid), submit(s, vid, *a)))
    monkeypatch.setattr(be, "_launch", lambda vid, *a: (launched.append(vid), launch(vid, *a))[1])
    ex = Executor(0, mg, tg, WorkerConfig(streams=streams, ahead=ahead), backend=be)
    try:
        for run in range(2):
            inputs = random_inputs(tg, run)
            ex.begin(inputs, delay=(0, 2e-4), seed=run)
            ex.dispatch(list(ex.core.mine))
            assert ex.wait(timeout=20), f"run {run} hung"
            assert ex.error is None, ex.error
            out = {k: ex.output(k, mg.outputs[k]) for k in tg.outputs}
            _same(out, evaluate(tg, inputs), f"run {run} ahead {ahead}")
            assert all(t0 <= t1 for _, _, t0, t1 in ex.trace)
        assert launched == submitted and len(launched) == 2 * len(ex.core.mine)
        assert (ex.launched_ahead > 0) == (ahead > 0)
        assert bool(FakeStream.waited) == (ahead > 0 and streams > 1)  # one stream: no waits
        host = ex.statistics()["backend"]["host"]
        assert host["launches"] == 2 * len(ex.core.mine) and host["launch_us_mean"] > 0, host
        assert host["blocking"] == 0
        assert (host["idle_s"] > 0) == (device_s > 0), host
        threads = list(ex.backend._threads)
        names = ["cuda-loop"] + [f"cuda-{k}-{s}" for k in ("wait", "blocking") for s in range(streams)]
        assert [t.name for t in threads] == names
    finally:
        ex.close()
    assert not any(t.is_alive() for t in threads)


def test_fake_device_loop_is_woken_by_the_same_vertex_twice(monkeypatch):
    """A vertex's events come back in the next run: the loop must arm its waker with them again."""
    from actors import backend_cuda

    install(monkeypatch.setattr)
    monkeypatch.setattr(FakeStream, "device_s", 2e-3)
    be = backend_cuda.CudaBackend()
    finished = threading.Semaphore(0)
    be.open(1, lambda vid, s: None, lambda *a: finished.release())
    try:
        for run in range(3):
            be.submit(0, 7)
            assert finished.acquire(timeout=10), f"run {run}: the loop was never woken"
        assert be.statistics()["host"]["idle_s"] > 0
    finally:
        be.close()


def test_a_failing_launch_loop_fails_the_run_instead_of_hanging(monkeypatch):
    """An error of the loop outside any vertex (here: re-reading the device clock) ends the run
    with an error naming the loop; nothing hangs."""
    from actors import backend_cuda
    from actors.executor import Executor, WorkerConfig

    install(monkeypatch.setattr)
    tg = random_taskgraph(7, n=20, gpus=1, size=16)
    mg = plan(tg, "roomy")
    ex = Executor(0, mg, tg, WorkerConfig(streams=2), backend=backend_cuda.CudaBackend())

    def broken(self, every_s=0.5):
        raise RuntimeError("device clock unreadable")

    monkeypatch.setattr(backend_cuda._Clock, "rebase", broken)
    try:
        ex.begin(random_inputs(tg, 0))
        ex.dispatch(list(ex.core.mine))
        assert ex.wait(timeout=20), "the run hung"
        assert ex.error is not None and "launch loop failed" in ex.error, ex.error
        assert "device clock unreadable" in ex.error
    finally:
        ex.close()


def test_bench_host_runs_the_llama_structure_on_the_stand_in_device(monkeypatch, capsys):
    """benchmarks/bench_host.py: llama_prefill's 7B vertex structure on the loop, outputs checked."""
    import importlib.util
    import pathlib

    from tests import fake_cuda

    monkeypatch.setattr(fake_cuda, "install", lambda: install(monkeypatch.setattr))  # undone after

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_host.py"
    spec = importlib.util.spec_from_file_location("bench_host", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--repeat", "1", "--streams", "2", "--ahead", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("llama_prefill structure: 572 vertices")
    assert lines[-1].split()[:2] == ["2", "4"]


@pytest.mark.parametrize("seed,check", [(0, False), (1, False), (2, True)])
def test_blocking_transfers_run_beside_the_loop_on_a_fake_device(monkeypatch, seed, check):
    """Transfers whose pull waits on the host run in helper threads while the loop holds their
    stream: the other streams go on, and nothing queued behind them (launch ahead; off under the
    sanitizer, which checks every read) starts early: the outputs match the reference."""
    from actors import backend_cuda, executor
    from actors.executor import WorkerConfig
    from actors.transport import LocalTransport
    from disco_ray.driver.engine_local import LocalEngine
    from disco_ray.driver.program import RunOptions

    install(monkeypatch.setattr)
    monkeypatch.setattr(executor, "make_backend", lambda name: backend_cuda.CudaBackend())
    helpers = set()
    pull = LocalTransport.pull

    def slow_pull(self, *a):  # a pull that waits on the host, like a Ray call
        helpers.add(threading.current_thread().name)
        time.sleep(1e-3)
        pull(self, *a)

    monkeypatch.setattr(LocalTransport, "pull", slow_pull)
    monkeypatch.setattr(LocalTransport, "blocks", lambda self, src: True)
    tg = random_taskgraph(seed, n=80, gpus=3, size=16)
    mg = plan(tg, "tight")
    eng = LocalEngine(tg, mg, config=WorkerConfig(backend="cuda", streams=2, ahead=2))
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
    from disco_ray.driver.engine_ray import RayPool

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

    from disco_ray.graph.errors import RunError
    from disco_ray.graph.memgraph import MKind, Read

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
    from actors.executor import make_backend
    from disco_ray.graph.errors import RunError

    with pytest.raises(RunError, match="no CUDA device"):
        make_backend("cuda")
