"""Shared fixtures: small hand-made graphs and a runner for the `python -m disco_ray` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from disco_ray.graph.memgraph import HOST, INPUT, Loc, MemGraph, MemVertex, MKind, Read
from disco_ray.graph.taskgraph import TaskGraph

ROOT = Path(__file__).resolve().parent.parent

# One auth mode for every Ray the suite starts: a local ray.init() would otherwise switch this
# process to token auth (and cache it), and a later driver of the multi-node test cluster, which
# runs without a token, would see its actors die at once.
os.environ["RAY_AUTH_MODE"] = "disabled"
# Never join a Ray someone else left running on this machine (`ray start`): each test starts its own.
os.environ["DISCO_RAY_ADDRESS"] = "local"


def two_gpu_graph() -> TaskGraph:
    """The FORMATS.md TaskGraph example: x0 @ w0 on gpu 0, then moved to gpu 1."""
    g = TaskGraph(gpus=2)
    x = g.input("x0", (64, 64), gpu=0)
    w = g.input("w0", (64, 64), gpu=0)
    m = g.matmul(x, w, id="m1")
    g.output(g.transfer(m, gpu=1, id="t1"))
    return g


def sample_memgraph() -> MemGraph:
    """A small MemGraph using every kind, both edge kinds, a host store and a src-null input reload."""
    g0 = lambda off: Loc(0, off, 16384)  # noqa: E731
    v = [
        MemVertex(0, MKind.INPUT, "x0", 0, (), g0(0)),
        MemVertex(1, MKind.INPUT, "w0", 0, (), g0(16384)),
        MemVertex(2, MKind.KERNEL, "m1", 0, (Read("x0", 0, g0(0)), Read("w0", 1, g0(16384))), g0(32768)),
        MemVertex(3, MKind.OFFLOAD, "m1", 0, (Read("m1", 2, g0(32768)),), Loc(HOST, 0, 16384)),
        MemVertex(4, MKind.KERNEL, "a1", 0, (Read("x0", 0, g0(0)),), g0(32768)),
        MemVertex(5, MKind.RELOAD, "m1", 0, (Read("m1", 3, Loc(HOST, 0, 16384)),), g0(16384)),
        MemVertex(6, MKind.RELOAD, "x0", 0, (Read("x0", None, Loc(INPUT, 0, 16384)),), g0(0)),
        MemVertex(7, MKind.TRANSFER, "t1", 1, (Read("m1", 5, g0(16384)),), Loc(1, 0, 16384)),
    ]
    edges = [
        (0, 2, "data"),
        (1, 2, "data"),
        (2, 3, "data"),
        (3, 4, "mem"),
        (0, 4, "data"),
        (3, 5, "data"),
        (4, 5, "mem"),
        (5, 7, "data"),
        (4, 6, "mem"),
    ]
    return MemGraph([65536, 32768], v, edges, {"t1": 7, "a1": 4}, [16384, 0], {"offloads": 1, "note": "x"})


def plan_of_two_gpu_graph(*, clobber: bool = False) -> MemGraph:
    """A hand-made correct MemGraph of two_gpu_graph(); `clobber` makes m1 overwrite its operand x0."""
    k = 16384
    m1_out = Loc(0, 0 if clobber else 2 * k, k)
    v = [
        MemVertex(0, MKind.INPUT, "x0", 0, (), Loc(0, 0, k)),
        MemVertex(1, MKind.INPUT, "w0", 0, (), Loc(0, k, k)),
        MemVertex(
            2, MKind.KERNEL, "m1", 0, (Read("x0", 0, Loc(0, 0, k)), Read("w0", 1, Loc(0, k, k))), m1_out
        ),
        MemVertex(3, MKind.TRANSFER, "t1", 1, (Read("m1", 2, m1_out),), Loc(1, 0, k)),
    ]
    edges = [(0, 2, "data"), (1, 2, "data"), (2, 3, "data")]
    return MemGraph([4 * k, 4 * k], v, edges, {"t1": 3}, [0, 0])


@pytest.fixture
def tg2() -> TaskGraph:
    return two_gpu_graph()


def run_cli(
    *args: str | os.PathLike, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Runs `python -m disco_ray ARGS` with this checkout first on the path, and `env` added."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "disco_ray", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


@pytest.fixture
def cli():
    return run_cli


# The modules that take longest (summed test seconds of a whole run, 2026-11-26), started first so
# that `-n 2 --dist loadfile` does not end on one of them alone while the other process idles.
LONGEST_FIRST = (
    "test_left_behind",
    "test_faults",
    "test_docs_run",
    "test_soak",
    "test_multinode",
    "test_models",
    "test_finetune",
    "test_nonfinite",
    "test_family_mistral",
    "test_family_phi3",
)


def pytest_collection_modifyitems(config, items):
    """Orders the longest modules first, the rest as collected (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_for_module(request):
    """Stops the process's shared Ray (tests/ray_fixtures.py) before a module that says
    `NO_SHARED_RAY = True` (its tests start their own Ray or check that none runs)."""
    if getattr(request.module, "NO_SHARED_RAY", False) and "tests.ray_fixtures" in sys.modules:
        sys.modules["tests.ray_fixtures"].SHARED.stop()
    yield


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_ray():
    yield
    if "tests.ray_fixtures" in sys.modules:
        sys.modules["tests.ray_fixtures"].SHARED.stop()
