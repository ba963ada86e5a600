"""Test helpers for the runtime: a small random TaskGraph generator and planning presets."""

from __future__ import annotations

import importlib
import random

import pytest

from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.taskgraph import Kind, TaskGraph
from planner import build_memgraph, min_capacity


def random_taskgraph(
    seed: int, n: int = 30, gpus: int = 2, dtype: str = "float32", size: int = 8
) -> TaskGraph:
    """A random DAG of inputs, elementwise ops, matmuls and transfers on `gpus` GPUs (square tiles)."""
    rng = random.Random(seed)
    g = TaskGraph(gpus=gpus)
    on: list[list[str]] = [[] for _ in range(gpus)]
    for gpu in range(gpus):
        for k in range(2):
            on[gpu].append(g.input(f"in{gpu}_{k}", (size, size), dtype, gpu=gpu))
    for i in range(n):
        gpu = rng.randrange(gpus)
        r = rng.random()
        if r < 0.15 and gpus > 1:
            src = rng.choice([x for x in range(gpus) if x != gpu])
            on[gpu].append(g.transfer(rng.choice(on[src][-6:]), gpu=gpu, id=f"t{i}"))
            continue
        pool = on[gpu][-6:]
        if r < 0.45:
            v = g.matmul(rng.choice(pool), rng.choice(pool), id=f"mm{i}")
            v = g.scale(v, 1.0 / size, id=f"s{i}")
        elif r < 0.7:
            v = g.add(*rng.sample(pool, min(len(pool), rng.randint(1, 3))), id=f"a{i}")
        elif r < 0.85:
            v = g.silu(rng.choice(pool), id=f"u{i}")
        else:
            v = g.rmsnorm(rng.choice(pool), id=f"r{i}")
        on[gpu].append(v)
    used = {x for v in g for x in v.inputs}
    outs = [v.id for v in g if v.id not in used and v.kind is not Kind.INPUT]
    g.output(*(outs or [list(g.vertices)[-1]]))
    return g


MODES = ("roomy", "tight")


def plan(tg: TaskGraph, mode: str = "roomy") -> MemGraph:
    """planner.build_memgraph with room for everything ("roomy") or barely enough ("tight": many
    offloads and reloads, reloads of inputs from the caller's copy, memory edges everywhere)."""
    return build_memgraph(tg, 1 << 24 if mode == "roomy" else tight_capacity(tg))


def tight_capacity(tg: TaskGraph, align: int = 256) -> int:
    """Barely more than the largest vertex needs (its distinct inputs and output)."""
    return max(min_capacity(tg, align)) + 2 * align


@pytest.fixture
def noop_op():
    """The `noop` test op (actors/testops.py), registered for one test only."""
    importlib.import_module("actors.testops")
    yield
    importlib.import_module("actors.testops").unregister()
