"""Weights read from their files at each load (`sources="disk"`) on the cuda backend, on the
stand-in device (tests/fake_cuda.py): a read runs beside the launch loop, as spill reloads do, so
the loop keeps launching and completing the other vertices while a read waits on the disk.
"""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import save_file

from actors.backends.base import Mode
from actors.backends.cuda import CudaBackend
from actors.executor import Executor
from actors.options import WorkerConfig
from actors.plans import PlanKind
from disco_ray.graph.reference import evaluate
from disco_ray.graph.sources import Source
from disco_ray.graph.taskgraph import TaskGraph
from planner import build_memgraph
from tests.fake_cuda import install

WAIT_S = 20.0  # bounds every wait: a hang fails the test instead of hanging it
READ_WAIT_S = 5.0  # how long the held read waits for the other chain before giving up


def graph(path: str) -> TaskGraph:
    """A chain on the caller's x, independent of a chain on weight w read from `path`."""
    g = TaskGraph()
    x = g.input("x", (4, 8))
    w = g.input("w", (8, 8), source=Source(path, "w"))
    g.output(g.scale(g.silu(x, id="hx"), 2.0, id="yx"), g.scale(w, 3.0, id="yw"))
    return g


@pytest.mark.parametrize("ahead", [0, 4])
def test_a_disk_read_does_not_hold_the_launch_loop(monkeypatch, tmp_path, ahead):
    """The read of w blocks until the x chain's first kernel has completed: with the read on the
    loop, nothing else launches or completes meanwhile and the read gives up (the run fails);
    beside the loop the x chain runs, the read goes on, and the outputs match the reference.
    (Planted: without the BLOCKING mode of streamed loads the read gives up and the test fails.)"""
    install(monkeypatch.setattr)
    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.randn(8, 8, generator=torch.Generator().manual_seed(1))}, path)
    tg = graph(path)
    mg = build_memgraph(tg, 1 << 20)
    ex = Executor(
        0, mg, tg, WorkerConfig(backend="cuda", streams=2, ahead=ahead, sources="disk"), backend=CudaBackend()
    )
    hx = next(v.id for v in mg.vertices if v.value == "hx")
    loads = [vid for vid, p in ex.plans.items() if p.kind is PlanKind.INPUT and p.value == "w"]
    ran_hx = threading.Event()
    done = ex._done  # the callback the backend calls (bound at open)

    def noting(vid, *rest):
        done(vid, *rest)
        if vid == hx:
            ran_hx.set()

    monkeypatch.setattr(ex.backend.loop, "done", noting)
    reader = ex.store.reader
    read = reader.read
    on_loop: list[bool] = []

    def held_read(*a, **kw):
        on_loop.append(threading.current_thread().name == "cuda-loop")
        if not ran_hx.wait(READ_WAIT_S):
            raise RuntimeError("the x chain made no progress while w was being read")
        return read(*a, **kw)

    monkeypatch.setattr(reader, "read", held_read)
    try:
        assert loads and all(ex._lanes(None)[1].get(v) is Mode.BLOCKING for v in loads)
        ins = {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(2))}
        ex.begin(ins)
        ex.dispatch(list(ex.core.mine))
        assert ex.wait(timeout=WAIT_S), "the run hung"
        assert ex.error is None, ex.error
        assert on_loop == [False], on_loop
        want = evaluate(tg, ins)
        for k in tg.outputs:
            torch.testing.assert_close(ex.output(k, mg.outputs[k]), want[k])
        assert ex.statistics()["backend"]["host"]["blocking"] >= 1
    finally:
        ex.close()
