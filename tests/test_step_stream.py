"""Each step of a `Program.run_steps` call reaches the caller as it ends (`on_step`), while the
worker runs the next: on the ray engine the worker's `run_steps` is a streaming generator.

The proof needs no clock: a gate kernel at the head of each step waits until the driver has let
its token through (a file the driver writes when its `on_step` sees the step before). Without
streaming the driver sees no step before the call ends, the second step's gate is never opened
and the call fails with the gate's error. A worker killed while it waits there ends the call with
an error naming it, the steps before it delivered. The thread that ends a step begins the
next (`actors.steps.iter_alone_steps`): in order, then their error.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from disco_ray.driver.api import compile
from disco_ray.graph import kernels, ops
from disco_ray.graph.errors import RunError
from disco_ray.graph.kernels_sample import as_bits
from disco_ray.graph.taskgraph import TaskGraph
from tests.ray_fixtures import pool  # noqa: F401  (module fixture for the ray tests)

V, ROWS, STEPS = 8, 2, 4
GATE_S = 30.0  # how long a gate waits for the driver before it fails the step


def _gate(out: torch.Tensor, ins: list[torch.Tensor], attrs) -> None:
    """out = tok, once the file `go<tok[0]>` exists in attrs["dir"]."""
    tok = int(ins[0][0])
    path = Path(attrs["dir"]) / f"go{tok}"
    t_end = time.monotonic() + GATE_S
    while not path.exists():
        if time.monotonic() > t_end:
            raise RuntimeError(
                f"the step of token {tok} was never let through: the driver saw no step before it"
            )
        time.sleep(0.005)
    out.copy_(ins[0])


@pytest.fixture
def gate_op():
    ops.register(
        ops.OpSpec("gate_own", 1, 1, lambda s, d, a: (s[0], d[0]), attrs={"dir": ops.REQUIRED}, doc="gate")
    )
    kernels.impl("gate_own")(_gate)
    yield
    kernels.unregister("gate_own")


def gated(gate_dir: Path) -> TaskGraph:
    """tok [ROWS] -> next = tok + 1 (mod V), each step behind a gate on its token."""
    g = TaskGraph(1)
    tok = g.input("tok", (ROWS,), "int64")
    table = g.input("table", (V, V), "float32")
    passed = g.kernel("gate_own", tok, id="passed", dir=str(gate_dir))
    logits = g.kernel("embedding", passed, table, id="logits")
    u = g.input("u", (ROWS,), "int64")
    params = g.input("samp", (3,), "int64")
    g.output(g.kernel("sample_tokens", logits, u, params, id="next"))
    return g


def feeds() -> list[dict[str, torch.Tensor]]:
    table = torch.zeros(V, V)
    table[torch.arange(V), (torch.arange(V) + 1) % V] = 1.0
    first = {
        "tok": torch.zeros(ROWS, dtype=torch.int64),
        "table": table,
        "u": as_bits(torch.zeros(ROWS, dtype=torch.float64)),
        "samp": as_bits(torch.zeros(3, dtype=torch.float64)),  # greedy
    }
    return [first] + [{} for _ in range(STEPS - 1)]


@pytest.mark.parametrize("engine", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_each_step_reaches_the_caller_before_the_next_runs(engine, request, gate_op, tmp_path):
    kw = {"pool": request.getfixturevalue("pool")} if engine == "ray" else {}
    seen: list[list[int]] = []

    def on_step(k: int, outs: dict[str, torch.Tensor]) -> None:
        nxt = outs["next"].tolist()
        assert not (tmp_path / f"go{nxt[0]}").exists()  # step k+1 has not run: its gate is shut
        seen.append(nxt)
        (tmp_path / f"go{nxt[0]}").touch()  # let step k+1 through

    (tmp_path / "go0").touch()
    with compile(gated(tmp_path), engine=engine, **kw) as prog:
        got = prog.run_steps(feeds(), carry={"next": "tok"}, on_step=on_step, timeout=120)
        if engine == "ray":  # one call to the worker for the steps
            assert prog.statistics()["engine"]["scheduler"]["coordinator"] is False
    assert seen == [o["next"].tolist() for o in got] == [[k + 1] * ROWS for k in range(STEPS)]


@pytest.mark.ray
def test_a_worker_killed_mid_stream_is_named(pool, gate_op, tmp_path):  # noqa: F811
    import ray

    seen: list[int] = []
    (tmp_path / "go0").touch()
    with compile(gated(tmp_path), engine="ray", pool=pool) as prog:
        victim = prog.engine.workers[0]

        def on_step(k: int, outs: dict[str, torch.Tensor]) -> None:
            seen.append(k)
            ray.kill(victim)  # it waits at step 1's gate, which stays shut

        with pytest.raises(RunError, match=r"gpu:0 worker.* died during the run while holding") as e:
            prog.run_steps(feeds(), carry={"next": "tok"}, on_step=on_step, timeout=120)
        assert e.value.step == 1 and seen == [0], str(e.value)


def test_each_step_is_begun_by_the_thread_that_ended_the_one_before(monkeypatch):
    """`iter_alone_steps` on a local executor: step 0 is begun by the caller, every later step by
    the stream thread that ran the last vertex of the step before (no hand-over between them);
    the steps come in order, and a step that cannot begin (a bad input at step 2) ends the
    iteration after the steps before it, with its error."""
    from actors.executor import Executor
    from actors.steps import iter_alone_steps
    from tests.test_run_steps import counter
    from tests.test_run_steps import feeds as counter_feeds

    prog = compile(counter(1), capacity="1MiB", engine="local")
    with prog:
        prog.run(counter_feeds([0, 0, 0], stop_at=-1, k=1)[0])  # the worker's copies of the inputs
        ex = prog._engine.execs[0]
        begun: list[str] = []
        begin = Executor.begin

        def spy(self, inputs, **kw):
            begun.append(threading.current_thread().name)
            return begin(self, inputs, **kw)

        monkeypatch.setattr(Executor, "begin", spy)
        wanted = [(v, prog.mg.outputs[v]) for v in prog.tg.outputs]
        steps = [{"left": torch.tensor([9, 9, 9])}] * 4
        got = [part for _, part, _, _ in iter_alone_steps(ex, steps, wanted, {"next": ["tok"]}, ["done"])]
        assert len(got) == 4 and begun[0] == threading.current_thread().name
        assert all(name.startswith("stream-") for name in begun[1:]), begun
        bad = [*steps[:2], {"left": torch.tensor([9, 9])}, steps[3]]  # 2 rows where 3 are planned
        seen = []
        with pytest.raises(RunError, match=r"input 'left' has 16 bytes, not 24"):
            seen.extend(iter_alone_steps(ex, bad, wanted, {"next": ["tok"]}, ["done"]))
        assert [more for *_, more in seen] == [True, True]
