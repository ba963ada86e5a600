"""Several steps of one plan per call (`Program.run_steps`, actors/steps.py): a counter graph whose
token input is carried from its token output (tok -> tok + 1 per step, chosen by `sample_tokens`
from an embedding of the token) and whose `finished_rows` output halts the call, against single
runs in turn: the same tokens on the local engine, on the ray engine's one-worker path (all
steps in one call to the worker) and over two workers (a loop of runs), and the bad calls.
"""

from __future__ import annotations

import pytest
import torch

from disco_ray.driver.api import compile
from disco_ray.graph.errors import RunError, UsageError
from disco_ray.graph.kernels_sample import as_bits
from disco_ray.graph.taskgraph import TaskGraph
from tests.ray_fixtures import pool  # noqa: F401  (module fixture for the ray tests)

V, ROWS = 16, 3


def counter(gpus: int) -> TaskGraph:
    """tok [ROWS] -> next = tok + 1 (mod V): the argmax of row tok of a table whose row i peaks at
    i + 1, looked up on the last GPU and sampled on GPU 0; done: `finished_rows` of next."""
    g = TaskGraph(gpus)
    last = gpus - 1
    tok = g.input("tok", (ROWS,), "int64", gpu=last)
    table = g.input("table", (V, V), "float32", gpu=last)
    logits = g.kernel("embedding", tok, table, id="logits")
    if last:
        logits = g.transfer(logits, 0, id="logits_to0")
    u = g.input("u", (ROWS,), "int64", gpu=0)
    params = g.input("samp", (3,), "int64", gpu=0)
    nxt = g.kernel("sample_tokens", logits, u, params, id="next", gpu=0)
    stop = g.input("stop", (ROWS, 2), "int64", gpu=0)
    left = g.input("left", (ROWS,), "int64", gpu=0)
    done = g.kernel("finished_rows", nxt, stop, left, id="done", gpu=0)
    g.output(nxt, done)
    return g


def feeds(start: list[int], stop_at: int, k: int) -> list[dict[str, torch.Tensor]]:
    """k steps from tokens `start`; row 1 stops at token `stop_at`; row 2 makes at most 5."""
    table = torch.zeros(V, V)
    table[torch.arange(V), (torch.arange(V) + 1) % V] = 1.0
    first = {
        "tok": torch.tensor(start),
        "table": table,
        "u": as_bits(torch.zeros(ROWS, dtype=torch.float64)),
        "samp": as_bits(torch.zeros(3, dtype=torch.float64)),  # greedy
        "stop": torch.tensor([[-1, -1], [stop_at, -1], [-1, -1]]),
    }
    return [{**(first if s == 0 else {}), "left": torch.tensor([100, 100, 5 - s])} for s in range(k)]


def one_by_one(prog, steps: list[dict]) -> list[list[int]]:
    """The tokens of single runs in turn, each fed the last one's: what run_steps must equal."""
    out, tok = [], None
    for feed in steps:
        got = prog.run({**feed, **({} if tok is None else {"tok": tok})})
        tok = got["next"]
        out.append(tok.tolist())
        if got["done"].any():
            break
    return out


def check_counter(prog) -> None:
    steps = feeds([0, 3, 9], stop_at=6, k=8)
    got = prog.run_steps(steps, carry={"next": "tok"}, halt="done")
    # row 1 reaches its stop id 6 at the third step: the call ends there
    assert [o["next"].tolist() for o in got] == [[1, 4, 10], [2, 5, 11], [3, 6, 12]]
    assert [o["done"].tolist() for o in got] == [[0, 0, 0], [0, 0, 0], [0, 1, 0]]
    assert len(prog.last_steps) == 3 and prog.last_records is prog.last_steps[-1]
    assert one_by_one(prog, steps) == [o["next"].tolist() for o in got]
    # no stop: row 2's max of 5 new tokens ends the call after 5 steps; later calls reuse inputs
    longer = prog.run_steps(feeds([0, 0, 0], stop_at=-1, k=8), carry={"next": ["tok"]}, halt=["done"])
    assert [o["next"].tolist()[2] for o in longer] == [1, 2, 3, 4, 5]
    no_halt = prog.run_steps([{"left": torch.tensor([9, 9, 9])}] * 4, carry={"next": "tok"})
    assert len(no_halt) == 4  # the worker's copies of the other inputs, from the last call


def test_steps_on_the_local_engine_equal_single_runs():
    with compile(counter(1), engine="local") as prog:
        check_counter(prog)


@pytest.mark.ray
@pytest.mark.parametrize("gpus", [1, 2])
def test_steps_on_the_ray_engine_equal_single_runs(pool, gpus):  # noqa: F811
    with compile(counter(gpus), engine="ray", pool=pool) as prog:
        check_counter(prog)
        prog.run_steps(feeds([1, 2, 3], stop_at=5, k=3), carry={"next": "tok"}, halt="done", check=True)
        if gpus == 1:  # one call for every step: the worker counted them, no coordinator
            stats = prog.statistics()["engine"]["scheduler"]
            assert stats["coordinator"] is False and stats["completed"] == 3 * len(prog.mg)


def test_bad_steps_are_refused_before_anything_runs():
    with compile(counter(1), engine="local") as prog:
        steps = feeds([0, 1, 2], stop_at=4, k=3)
        with pytest.raises(UsageError, match="'logits' is not an output"):
            prog.run_steps(steps, carry={"logits": "tok"})
        with pytest.raises(UsageError, match="is not an input the caller hands in"):
            prog.run_steps(steps, carry={"next": "next"})
        with pytest.raises(UsageError, match=r"output 'done' is \[3\] int64, input 'stop' \[3, 2\]"):
            prog.run_steps(steps, carry={"done": "stop"})
        with pytest.raises(UsageError, match="halt: 'tok'"):
            prog.run_steps(steps, carry={"next": "tok"}, halt="tok")
        with pytest.raises(RunError, match=r"step 1: inputs \['tok'\] are carried"):
            prog.run_steps(
                [steps[0], {**steps[1], "tok": torch.zeros(3, dtype=torch.int64)}], carry={"next": "tok"}
            )
        with pytest.raises(RunError, match="step 1: input 'left' has shape"):
            prog.run_steps([steps[0], {"left": torch.zeros(2, dtype=torch.int64)}], carry={"next": "tok"})
        with pytest.raises(UsageError, match="non-empty list"):
            prog.run_steps([], carry={})
        assert prog.held == frozenset()  # nothing ran


@pytest.mark.parametrize("engine", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_kernel_failing_at_a_later_step_ends_the_call_naming_it(engine, request):
    """Token 3's table row is NaN: the second step's sample_tokens raises (row 2); the error names the
    worker, the vertex and the row, and the Program runs again afterwards."""
    kw = {"pool": request.getfixturevalue("pool")} if engine == "ray" else {}
    with compile(counter(1), engine=engine, **kw) as prog:
        steps = feeds([0, 1, 2], stop_at=-1, k=4)
        steps[0]["table"][3] = float("nan")
        with pytest.raises(RunError, match=r"gpu:0 .*next.* non-finite logits in row 2"):
            prog.run_steps(steps, carry={"next": "tok"}, halt="done", timeout=60)
        assert prog.run_steps(feeds([0, 1, 2], stop_at=-1, k=2), carry={"next": "tok"})[1][
            "next"
        ].tolist() == [2, 3, 4]
