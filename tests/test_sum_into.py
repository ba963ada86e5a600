"""Sum-into accumulation (TURNIP appendix A): an `accumulate`'s kernels, one per operand, add into
one range in any order, one at a time; the worker core's write lock and the runtime."""

from __future__ import annotations

import pytest
import torch

from actors.worker_core import WorkerCore
from disco_ray.driver.program import Program
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.reference import evaluate
from disco_ray.graph.taskgraph import TaskGraph
from tests.memgraph_helpers import execute_random_order, naive_memgraph


def grads(n: int = 5, gpus: int = 1) -> TaskGraph:
    """n partials (each a product of two inputs), their accumulate, and a reader of the sum."""
    g = TaskGraph(gpus)
    parts = []
    for k in range(n):
        j = k % gpus
        a, b = g.input(f"a{k}", (4, 4), gpu=j), g.input(f"b{k}", (4, 4), gpu=j)
        p = g.matmul(a, b, id=f"p{k}")
        parts.append(p if j == 0 else g.transfer(p, 0, id=f"p{k}_to0"))
    acc = g.kernel("accumulate", *parts, id="acc")
    g.output(g.scale(acc, 2.0, id="out"))
    return g


def inputs(tg: TaskGraph, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {v.id: torch.randn(v.shape, generator=gen) for v in tg.caller_inputs()}


def test_the_core_lets_one_member_of_a_group_run_at_a_time():
    tg = grads(4)
    mg = naive_memgraph(tg)
    members = [v.id for v in mg.vertices if v.acc is not None]
    assert [mg.vertex(m).acc for m in members] == [(k, 4) for k in range(4)]
    core = WorkerCore(mg, 0)
    core.start(ahead=True)
    core.dispatch([v.id for v in mg.vertices])
    order = []
    while not core.finished:
        v = core.pop()
        assert v is not None
        core.launch(v)
        running = {v}
        if v in members:
            # no other member is ready while this one holds the lock
            assert not any(w in members for w in core.ready), core.ready
            order.append(v)
        core.complete(running.pop())
    assert sorted(order) == members


@pytest.mark.parametrize("seed", range(6))
def test_members_in_any_order_sum_to_the_reference(seed):
    tg = grads(6)
    ins = inputs(tg, seed)
    want = evaluate(tg, ins)["out"]
    got = execute_random_order(naive_memgraph(tg), tg, ins, seed)["out"]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_runtime_runs_sum_into_under_the_lock_with_random_delays(gpus):
    tg = grads(6, gpus)
    mg = naive_memgraph(tg)
    with Program(tg, mg, engine="local", streams=4) as prog:
        for seed in range(4):
            ins = inputs(tg, seed)
            out = prog.run(ins, delay=(0, 2e-3), seed=seed, check=True)["out"]
            torch.testing.assert_close(out, evaluate(tg, ins)["out"])


def test_memgraph_accumulate_round_trips_and_is_checked():
    mg = naive_memgraph(grads(3))
    back = MemGraph.from_dict(mg.to_dict())
    assert [v.acc for v in back.vertices] == [v.acc for v in mg.vertices]
    doc = mg.to_dict()
    doc["vertices"][-3]["accumulate"] = {"part": 3, "parts": 3}
    with pytest.raises(Exception, match="accumulate"):
        MemGraph.from_dict(doc)
