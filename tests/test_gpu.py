"""The cuda backend and its transports on a real GPU (marked `gpu`, skipped without CUDA).

Several Ray workers share the one GPU (fractional num_gpus), each with its own arena, so the
multi-GPU logic (transfers between arenas over CUDA IPC) runs on a single device. The path
choice is pure and also tested without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from actors.transports.cuda import choose_path, choose_paths
from disco_ray.driver.program import Program
from disco_ray.graph.reference import evaluate, random_inputs
from tests.runtime_helpers import plan, random_taskgraph

NO_SHARED_RAY = True  # its pools start a Ray with the machine's real GPUs

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
def _info(node="n0", uuid="GPU-0", ipc=True, nccl=True, device=0, peers=()):
    return {
        "node": node,
        "uuid": uuid,
        "ipc": ipc,
        "nccl": nccl,
        "p2p": ipc,
        "device": device,
        "visible": "0,1",
        "peer_access": list(peers),
    }


def test_path_choice():
    assert choose_path(_info(), _info()) == "ipc"  # workers sharing one GPU
    assert choose_path(_info(), _info(ipc=False)) == "ray"  # same GPU: NCCL refuses two ranks there
    assert choose_path(_info(), _info(uuid="GPU-1")) == "nccl"  # two GPUs of one node, no peer access
    assert choose_path(_info(), _info(node="n1", uuid="GPU-1")) == "nccl"  # two nodes
    assert choose_path(_info(), _info(uuid="GPU-1", nccl=False)) == "ray"  # no cupy on one side
    assert choose_path(_info(), _info(), allow=("ray",)) == "ray"
    # two GPUs of one node that see each other (the node's devices shared) and have peer access
    a, b = _info(uuid="GPU-0", device=0, peers=[1]), _info(uuid="GPU-1", device=1, peers=[0])
    assert choose_path(a, b) == "p2p"
    assert choose_path(a, {**b, "visible": "1"}) == "nccl"  # each sees only its own GPU (Ray's default)
    assert choose_path(a, {**b, "peer_access": []}) == "nccl"  # no peer access one way
    assert choose_path(a, {**b, "node": "n1"}) == "nccl"
    assert choose_path(a, b, allow=("ipc", "nccl", "ray")) == "nccl"
    # NCCL takes one rank per GPU: worker 1 shares GPU-0 with worker 0, so its pair goes through Ray
    infos = [_info(), _info(), _info(uuid="GPU-1")]
    assert choose_paths(infos) == {(0, 1): "ipc", (0, 2): "nccl", (1, 2): "ray"}


def test_workers_of_a_node_share_their_devices():
    from actors.transports.cuda import shared_visible

    assigned = [("n0", ["3"]), ("n0", ["1"]), ("n1", ["0"]), ("n0", ["3"]), ("n1", ["2"])]
    assert shared_visible(assigned) == [("1,3", 1), ("1,3", 0), ("0,2", 0), ("1,3", 1), ("0,2", 1)]


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
@pytest.mark.parametrize("graph", ["random", "llama"])
def test_no_device_allocation_while_graphs_run(graph):
    """No cudaMalloc during runs: the arenas and each compute stream's reserved temporaries
    (attention's among them, for llama) are made before."""
    if graph == "llama":
        from workloads.llama import llama_prefill

        w = llama_prefill(preset="tiny", layers=2, gpus=2, seq=256, tile=64)
        tg, fixed = w.taskgraph, w.inputs
    else:
        tg, fixed = random_taskgraph(21, n=40, gpus=2, size=64), None
    with Program(tg, plan(tg, "tight"), engine="local", backend="cuda", streams=3) as prog:
        assert prog.engine is not None  # arenas, streams and per-stream workspaces are made here
        torch.cuda.synchronize()
        segments = [torch.cuda.memory_stats()["segment.all.allocated"]]
        for run in range(3):
            inputs = fixed or random_inputs(tg, run)
            out = prog.run(inputs, delay=(0, 2e-4) if run else None, seed=run, timeout=120)
            segments.append(torch.cuda.memory_stats()["segment.all.allocated"])
            _same(out, evaluate(tg, inputs), f"run {run}")
    assert segments == segments[:1] * 4, f"cudaMalloc calls: {segments} (before, after each run)"


@pytest.mark.gpu
@needs_cuda
def test_inputs_are_staged_in_pinned_memory():
    from actors.executor import Executor
    from actors.options import WorkerConfig

    tg = random_taskgraph(22, n=20, gpus=1, size=32)
    mg = plan(tg, "tight")
    ex = Executor(0, mg, tg, WorkerConfig("cuda", streams=2))
    try:
        assert ex.staging is not None and ex.staging.is_pinned()
        assert ex.host.numel() == 0 or ex.host.is_pinned()
        assert ex.arena.is_cuda
        ex.begin(random_inputs(tg, 0))
        assert all(t.is_pinned() for t in ex.loads.inputs.values())
    finally:
        ex.close()


# ---- ray engine: 2-4 workers sharing the GPU, transfers over CUDA IPC ----------------------------
def _ray_pool(num_gpus: int):
    """A RayPool on a local Ray with `num_gpus` GPUs (started here unless one runs), then removed;
    skipped with fewer GPUs."""
    if not CUDA or torch.cuda.device_count() < num_gpus:
        pytest.skip(f"needs {num_gpus} CUDA device(s)")
    ray = pytest.importorskip("ray")
    from disco_ray.driver.pool import RayPool

    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local", num_cpus=8, num_gpus=num_gpus, include_dashboard=False, logging_level="WARNING"
        )
    p = RayPool()
    yield p
    p.discard()
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def gpu_pool():
    yield from _ray_pool(1)


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
        why = prog.last_summary["transport_fallbacks"]
        assert set(why) == {"0-1"} and "ipc: left out (DISCO_CUDA_PATHS)" in why["0-1"], why


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.parametrize("path", ["ipc", "ray"])
def test_device_memory_comes_back_after_close_and_resize(gpu_pool, monkeypatch, path):
    """Three workers sharing the GPU, arenas of 512 MiB: `mem_get_info` shows the memory back
    after a resize and after close (ipc: peers rebuild the exports; ray: every export is released
    by its own worker; actors/transports/ipc.py), beyond what the workers' CUDA contexts keep."""
    from planner import build_memgraph

    monkeypatch.setenv("DISCO_CUDA_PATHS", path)
    gpu_pool.discard()
    tg = random_taskgraph(441, n=40, gpus=3, size=32)
    inputs = random_inputs(tg, 0)
    with Program(tg, plan(tg, "tight"), engine="ray", backend="cuda", pool=gpu_pool, streams=2) as prog:
        prog.run(inputs, timeout=180)  # the workers' CUDA contexts and cuBLAS handles are made
    base = torch.cuda.mem_get_info()[0]
    with Program(
        tg, build_memgraph(tg, 512 << 20), engine="ray", backend="cuda", pool=gpu_pool, streams=2
    ) as prog:
        _same(prog.run(inputs, timeout=180), evaluate(tg, inputs), f"{path} 512 MiB")
        assert base - torch.cuda.mem_get_info()[0] >= 3 * (512 << 20), "the arenas are not on the GPU"
        prog.resize(64 << 20)
        held = base - torch.cuda.mem_get_info()[0]  # the three new arenas of 64 MiB, not the old
        assert held < 4 * (64 << 20), f"{held} bytes held after the resize to 3 x 64 MiB"
        _same(prog.run(inputs, timeout=180), evaluate(tg, inputs), f"{path} 64 MiB")
    held = base - torch.cuda.mem_get_info()[0]
    assert held < 64 << 20, f"{held} bytes still held after close"


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
        Program(tg, bad, engine="ray", backend="cuda", pool=gpu_pool, trusted=True) as prog,
        pytest.raises(RunError, match=f"vertex {v.id}"),
    ):
        prog.run(random_inputs(tg, 0), check=True, timeout=180)


# ---- two GPUs: peer copies and NCCL (skipped with fewer) -----------------------------------------
TWO_GPUS = CUDA and torch.cuda.device_count() >= 2
needs_two = pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")


@pytest.mark.gpu
@needs_cuda
def test_the_nccl_calls_the_channel_makes_on_one_rank():
    """cupy's NCCL as the channel uses it (names, a group, the async-error check), on one rank:
    two ranks on one GPU are refused by NCCL, so this is what a one-GPU machine can check."""
    from actors.transports.cuda import nccl_module

    nccl = nccl_module()
    if nccl is None:
        pytest.skip("no cupy NCCL here")
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    try:
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        st = torch.cuda.Stream()
        torch.cuda.synchronize()
        nccl.groupStart()  # a rank's send to itself must be grouped with its recv
        comm.send(src.data_ptr(), src.numel(), nccl.NCCL_UINT8, 0, st.cuda_stream)
        comm.recv(dst.data_ptr(), dst.numel(), nccl.NCCL_UINT8, 0, st.cuda_stream)
        nccl.groupEnd()
        st.synchronize()
        comm.check_async_error()
        assert torch.equal(src, dst)
    finally:
        comm.destroy()


@pytest.fixture(scope="module")
def two_gpu_pool():
    yield from _ray_pool(2)


@pytest.mark.gpu
@pytest.mark.ray
@needs_two
@pytest.mark.parametrize("paths", ["p2p,nccl,ray", "nccl,ray"])
def test_two_gpus_transfer_over_peer_copies_or_nccl(two_gpu_pool, monkeypatch, paths):
    """Two workers on two GPUs: with peer access, the driver lets them see each other's GPU and
    transfers are peer copies; without it (or narrowed to NCCL), NCCL in one agreed order. Both
    directions at once, with the sanitizer, and the summary names the path opened."""
    monkeypatch.setenv("DISCO_CUDA_PATHS", paths)
    two_gpu_pool.discard()  # fresh actors: CUDA must not have started in them yet
    tg = random_taskgraph(441, n=80, gpus=2, size=64)
    mg = plan(tg, "tight")
    with Program(tg, mg, engine="ray", backend="cuda", pool=two_gpu_pool, streams=3) as prog:
        for run in range(2):
            inputs = random_inputs(tg, run)
            out = prog.run(inputs, check=run == 0, delay=(0, 5e-4) if run else None, seed=run, timeout=180)
            _same(out, evaluate(tg, inputs), f"{paths} run {run}")
        opened = prog.last_summary["transports"]["0-1"]
        stats = prog.statistics()["engine"]["workers"]
    peer_access = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
    assert opened == ("p2p" if paths.startswith("p2p") and peer_access else "nccl"), opened
    assert sum(w["transport"]["pulls"][opened] for w in stats) > 0


def test_cuda_backend_refused_without_cuda():
    if CUDA:
        pytest.skip("CUDA present")
    from actors.backends import make_backend
    from disco_ray.graph.errors import RunError

    with pytest.raises(RunError, match="no CUDA device"):
        make_backend("cuda")
