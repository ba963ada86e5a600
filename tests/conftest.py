"""Shared fixtures: small hand-made graphs and a runner for the `python -m disco_ray` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from disco_ray.taskgraph import TaskGraph

ROOT = Path(__file__).resolve().parent.parent


def two_gpu_graph() -> TaskGraph:
    """The FORMATS.md TaskGraph example: x0 @ w0 on gpu 0, then moved to gpu 1."""
    g = TaskGraph(gpus=2)
    x = g.input("x0", (64, 64), gpu=0)
    w = g.input("w0", (64, 64), gpu=0)
    m = g.matmul(x, w, id="m1")
    g.output(g.transfer(m, gpu=1, id="t1"))
    return g


@pytest.fixture
def tg2() -> TaskGraph:
    return two_gpu_graph()


def run_cli(*args: str | os.PathLike, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs `python -m disco_ray ARGS` with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
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
