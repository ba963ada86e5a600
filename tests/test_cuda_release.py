"""Device memory comes back after close and resize on multi-worker CUDA, on the stand-ins
(tests/fake_cuda.py counts live device allocations; tests/fake_ipc.py keeps torch's IPC
reference counts): each worker exports its arena once per peer, and every export is released
once, by the peer that rebuilt it or by the worker itself (actors/transports/ipc.py).

What this cannot show: the real allocator's limbo and `torch.cuda.mem_get_info` (tests/test_gpu.py
and benchmarks/gpu_session.sh on a GPU).
"""

from __future__ import annotations

import gc

import pytest
import torch

from actors import resources
from actors.backends.cuda import CudaBackend
from actors.options import RunOptions, WorkerConfig
from actors.transports import cuda as transport_cuda
from actors.transports.cuda import CudaTransport, choose_paths
from disco_ray.driver.engine_local import LocalEngine, LocalPool
from disco_ray.graph.reference import evaluate, random_inputs
from tests import fake_cuda, fake_ipc, fake_nccl
from tests.fake_cuda import install
from tests.runtime_helpers import plan, random_taskgraph

WAIT_S = 30.0


def _live() -> int:
    gc.collect()
    return len(fake_cuda.DEVICE_LIVE)


def _infos(eng: LocalEngine, path: str) -> list[dict]:
    """Each worker's `describe`, as if each ran in a process of its own (so IPC pairs open), on
    one GPU (ipc) or one GPU each (p2p, nccl, ray)."""
    infos = []
    n = len(eng.execs)
    for g, ex in enumerate(eng.execs):
        info = ex.transport.describe()
        info["pid"] = -1 - g
        if path != "ipc":
            info.update(uuid=f"GPU-{g}", device=g, visible=",".join(map(str, range(n))))
            info["peer_access"] = [d for d in range(n) if d != g]
        infos.append(info)
    return infos


def connected(tg, mg, path: str, pool: LocalPool) -> LocalEngine:
    """The local engine with a CudaTransport per worker, every pair on `path`, connected as the
    driver does (every worker's connect at once)."""
    n = mg.gpus
    eng = LocalEngine(
        tg,
        mg,
        config=WorkerConfig(backend="cuda", streams=2, ahead=0),
        pool=pool,
        transports=lambda execs: [CudaTransport(g, [None] * n) for g in range(n)],
    )
    infos = _infos(eng, path)
    paths = choose_paths(infos, allow=(path,))
    assert set(paths.values()) == {path}, paths
    uid = fake_nccl.get_unique_id()
    fake_nccl.connect_all(eng, infos, paths, uid, WAIT_S)
    return eng


@pytest.mark.parametrize("path,gpus", [("ipc", 2), ("ipc", 3), ("p2p", 2), ("nccl", 2), ("ray", 2)])
def test_device_memory_comes_back_after_close_and_resize(monkeypatch, path, gpus):
    """Load, run (not over Ray's object store: no Ray here), close: no device allocation is
    left; load again at another capacity on the same workers (a resize), run, close: none left
    either. Every export was released exactly once (fake_ipc records a second release).
    (Planted: exports never released leave allocations; one export shared by two ipc peers is
    released twice.) The second load takes the streams the first made: torch keeps a cuBLAS
    workspace per stream until the process ends, so new streams per load held 64 MiB per worker
    after every unload on the H100 (planted: streams made per `open`)."""
    fake = install(monkeypatch.setattr, gpus=gpus)
    made: list = []
    stream = fake.torch.cuda.Stream
    monkeypatch.setattr(fake.torch.cuda, "Stream", lambda *a, **k: made.append(stream(*a, **k)) or made[-1])
    fake_ipc.install(monkeypatch.setattr)
    monkeypatch.setattr(resources, "make_backend", lambda name, device=None: CudaBackend(device))
    monkeypatch.setattr(transport_cuda, "nccl_module", lambda: fake_nccl)
    tg = random_taskgraph(31 + gpus, n=60, gpus=gpus, size=8)
    pool = LocalPool()
    before, exports = _live(), fake_ipc.live_exports()
    fake_ipc.ERRORS.clear()
    for mode in ("roomy", "tight"):  # the second load is a resize: another capacity, same stores
        mg = plan(tg, mode)
        eng = connected(tg, mg, path, pool)
        try:
            assert _live() == before + gpus, "one arena per worker"
            for ex in eng.execs:
                st = ex.transport.statistics()["ipc_exports"]
                assert st["made"] == gpus - 1, st
                assert st["owed"] == 0, st  # taken over by a peer, or released at connect
            if path != "ray":
                for run in range(2):
                    inputs = random_inputs(tg, run)
                    out, _ = eng.run(inputs, RunOptions(timeout=WAIT_S))
                    for k, want in evaluate(tg, inputs).items():
                        torch.testing.assert_close(out[k], want, rtol=1e-4, atol=1e-4)
        finally:
            eng.close()
        del eng
        assert _live() == before, f"{mode}: {_live() - before} device allocations left after close"
        if mode == "roomy":
            streams = len(made)
            assert streams >= 2, "each device's streams are made at the first load"
        else:
            assert len(made) == streams, f"the second load made {len(made) - streams} new streams"
        assert fake_ipc.live_exports() == exports, "an export still holds an arena"
        assert not fake_ipc.ERRORS, fake_ipc.ERRORS
