"""The written contracts of backends, transports and the spill tier (actors/backends/base.py,
actors/transports/base.py, actors/tiers/base.py): a backend and a transport written from the
Protocols and base classes alone run graphs on the local engine, and the runtime uses no member
of a backend, transport or tier that its Protocol does not declare, nor probes one with
getattr/hasattr."""

from __future__ import annotations

import ast
import queue
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pytest
import torch

from actors import backends
from actors.backends.base import Backend, BackendBase, Done, Mode, Work
from actors.options import RunOptions, WorkerConfig
from actors.tiers.base import ReloadAhead, SpillTier
from actors.transports.base import Transport, TransportBase
from disco_ray.driver.engine_local import LocalEngine
from disco_ray.graph.errors import UsageError
from disco_ray.graph.kernels import IMPLS
from disco_ray.graph.memgraph import Loc, MKind
from disco_ray.graph.reference import evaluate, random_inputs
from tests.conftest import ROOT
from tests.runtime_helpers import plan, random_taskgraph


class OneThreadBackend(BackendBase):
    """The least a backend needs: host tensors, and every stream's work on one thread in
    submission order (a vertex of `waits` was submitted earlier, so it has finished)."""

    name = "one-thread"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.ran = 0

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def open(
        self, streams: int, work: Work, done: Done, workspace: int = 0, kernel_streams: int | None = None
    ) -> None:
        self.thread = threading.Thread(target=self._loop, args=(work, done), daemon=True)
        self.thread.start()

    def _loop(self, work: Work, done: Done) -> None:
        while (job := self.jobs.get()) is not None:
            vid, stream = job
            t0, exc = time.time_ns(), None
            try:
                work(vid, stream)
            except BaseException as e:  # handed to the executor, which fails the run
                exc = e
            self.ran += 1
            done(vid, stream, t0, time.time_ns(), exc)

    def submit(self, stream: int, vid: int, waits: tuple[int, ...] = (), mode: Mode = Mode.LAUNCH) -> None:
        self.jobs.put((vid, stream))  # never run here: the executor holds its lock

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def kernel(self, op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
        IMPLS[op](out, ins, attrs)

    def close(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join(timeout=5)
            self.thread = None


class CountingTransport(TransportBase):
    """The least a transport needs (`mode`, `pull`: a copy out of the peer executor), plus the
    optional hooks of a run, counted."""

    def __init__(self, peers: Sequence[Any]):
        self.peers = peers
        self.ex: Any = None
        self.pulls = self.runs = 0
        self.seen: list[int] = []

    def mode(self, src_gpu: int) -> Mode:
        return Mode.LAUNCH

    def pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        self.pulls += 1
        self.peers[src_gpu].read_range(loc, reader, expect, into=dst)

    def attach(self, executor: Any) -> None:
        self.ex = executor

    def begin_run(self) -> None:
        self.runs += 1

    def watched(self) -> Collection[int]:
        return set(self.ex.plans)  # every vertex of this worker

    def completed(self, vid: int) -> None:
        self.seen.append(vid)


@pytest.fixture
def one_thread(monkeypatch):
    """Backend "one-thread" in the registry, for this test only; yields the backends it made."""
    made: list[OneThreadBackend] = []

    def factory(device: int | None) -> Backend:
        made.append(OneThreadBackend())
        return made[-1]

    monkeypatch.setitem(backends.BACKENDS, "one-thread", factory)
    return made


@pytest.mark.parametrize("mode", ["roomy", "tight"])
@pytest.mark.parametrize("seed", range(3))
def test_a_backend_and_a_transport_written_from_the_contracts_run_graphs(one_thread, seed, mode):
    tg = random_taskgraph(seed, n=30, gpus=2)
    mg = plan(tg, mode)
    transports: list[CountingTransport] = []

    def make(execs: list) -> list[Transport]:
        transports.extend(CountingTransport(execs) for _ in range(mg.gpus))
        return list(transports)

    eng = LocalEngine(tg, mg, config=WorkerConfig(backend="one-thread", streams=2), transports=make)
    units = 0  # calls of `work` that ran a chain of kernels (a unit) instead of one vertex
    try:
        for run in range(2):
            inputs = random_inputs(tg, seed + run)
            check = run == 1  # the sanitizer too (its after-pull hook: the base class's; no units)
            out, _ = eng.run(inputs, RunOptions(check=check))
            units += sum(ex.slots.chained[1] - ex.slots.chained[0] for ex in eng.execs)
            ref = evaluate(tg, inputs)
            assert set(out) == set(ref)
            for k in ref:
                assert torch.allclose(out[k], ref[k], atol=1e-5, rtol=1e-5), (k, seed, mode, run)
    finally:
        eng.close()
    workers = [b for b in one_thread if b.ran]  # the pool's stores made some only to allocate
    assert len(workers) == mg.gpus
    assert sum(b.ran for b in workers) == 2 * len(mg.vertices) - units
    assert sum(t.pulls for t in transports) == 2 * sum(v.kind is MKind.TRANSFER for v in mg.vertices)
    for g, t in enumerate(transports):
        assert t.ex is eng.execs[g] and t.runs == 2
        assert sorted(t.seen) == sorted(2 * [v.id for v in mg.vertices if v.gpu == g])


def test_backends_by_name():
    assert {"cpu", "cuda"} <= set(backends.backend_names())
    assert backends.make_backend("cpu").name == "cpu"
    with pytest.raises(UsageError, match="unknown backend 'nope'"):
        backends.make_backend("nope")


def test_the_defaults_of_the_optional_hooks():
    b, t = OneThreadBackend(), CountingTransport([])
    assert (b.stages_inputs, b.async_launch, b.default_ahead, b.statistics()) == (False, False, 0, {})
    assert TransportBase.watched(t) == () and TransportBase.probe(t, 0, 1) is False
    assert TransportBase.statistics(t) == {}


# ---- the runtime uses only what the contracts declare ------------------------------------------
def members(proto: type) -> set[str]:
    """What a Protocol declares: its annotated attributes and its methods."""
    return {n for n in vars(proto) if not n.startswith("_")} | set(proto.__annotations__)


# per file: the expressions that hold a backend, a transport or a tier there
RECEIVERS: dict[str, dict[str, type]] = {
    "actors/executor.py": {
        "self.backend": Backend,
        "self.transport": Transport,
        "tr": Transport,
        "self.spill": SpillTier,
        "self._spill()": SpillTier,
        "self.read_ahead": ReloadAhead,
        "self._read_ahead()": ReloadAhead,
    },
    "actors/worker.py": {"backend": Backend, "transport": Transport, "self._graph(key)[1]": Transport},
    "disco_ray/driver/engine_local.py": {"b": Backend, "made[g]": Transport},
    "disco_ray/driver/cluster.py": {"transport": Transport},
    "actors/transports/cuda.py": {"ex.backend": Backend},
    "actors/transports/nccl.py": {"self.backend": Backend},
}


def contract_misuses(path: str, source: str, receivers: dict[str, type]) -> list[str]:
    """Members used on a receiver that its Protocol does not declare, and getattr/hasattr on one."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            proto = receivers.get(ast.unparse(node.value))
            if proto is not None and node.attr not in members(proto):
                bad.append((node.lineno, f"{ast.unparse(node)} is not in {proto.__name__}"))
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("getattr", "hasattr")
            and node.args
            and ast.unparse(node.args[0]) in receivers
        ):
            bad.append((node.lineno, f"{ast.unparse(node)} probes instead of a declared hook"))
    return [f"{path}:{line}: {what}" for line, what in sorted(bad)]


def test_the_runtime_uses_only_declared_hooks():
    bad = [
        b for path, recv in RECEIVERS.items() for b in contract_misuses(path, (ROOT / path).read_text(), recv)
    ]
    assert not bad, "\n".join(bad)


def test_the_check_finds_an_undeclared_hook_and_a_probe():
    src = "def f(self, tr):\n    self.backend.kernel()\n    self.backend.warp()\n    getattr(tr, 'x', None)\n"
    assert contract_misuses("x.py", src, {"self.backend": Backend, "tr": Transport}) == [
        "x.py:3: self.backend.warp is not in Backend",
        "x.py:4: getattr(tr, 'x', None) probes instead of a declared hook",
    ]
