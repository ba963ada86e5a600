"""Inputs a worker reads itself (safetensors sources), states runs save and later runs read
(`carry`), loads skipped when the arena still holds a value, and several graphs on one pool."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from actors.loads import stable_loads
from actors.plans import PlanKind, VertexPlan
from disco_ray.driver.api import compile
from disco_ray.driver.engine_local import LocalPool
from disco_ray.driver.program import Program
from disco_ray.graph import formats
from disco_ray.graph.errors import FormatError, GraphError, RunError
from disco_ray.graph.memgraph import Loc, MemGraph
from disco_ray.graph.reference import evaluate
from disco_ray.graph.sources import Source
from disco_ray.graph.taskgraph import TaskGraph
from planner import build_memgraph, min_capacity
from planner.verify import verify
from tests.ray_fixtures import pool  # noqa: F401  (module fixture: the ray engine cases)
from tests.runtime_helpers import tight_capacity


@pytest.fixture
def weights(tmp_path):
    gen = torch.Generator().manual_seed(0)
    w = {f"w{i}": torch.randn(16, 8, generator=gen) for i in range(4)}
    path = tmp_path / "w.safetensors"
    save_file(w, str(path))
    return path, w


def chain(path, gpus: int = 1) -> TaskGraph:
    """x [4, 8] through four sourced weights; w_i's rows split over the GPUs (tensor-parallel)."""
    g = TaskGraph(gpus=gpus)
    rows = 16 // gpus
    x = g.input("x_g0", (4, 8), gpu=0)
    h = [x] + [g.transfer(x, j, id=f"x_to{j}") for j in range(1, gpus)]
    for i in range(4):
        parts = []
        for j in range(gpus):
            src = Source(str(path), f"w{i}", ((j * rows, (j + 1) * rows),))
            w = g.input(f"w{i}_g{j}", (rows, 8), gpu=j, source=src)
            y = g.linear(h[j], w, id=f"y{i}_g{j}")  # [4, rows]
            parts.append(g.matmul(y, g.input(f"p{i}_g{j}", (rows, 8), gpu=j), id=f"z{i}_g{j}"))
        s = g.add(parts[0], *[g.transfer(p, 0, id=f"m{i}_{j}") for j, p in enumerate(parts) if j], id=f"s{i}")
        s = g.scale(s, 0.1, id=f"n{i}")
        h = [s] + [g.transfer(s, j, id=f"b{i}_{j}") for j in range(1, gpus)]
    g.output(h[0])
    return g


def chain_inputs(tg: TaskGraph, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {v.id: torch.randn(v.shape, generator=gen) for v in tg.caller_inputs()}


def expected(w, ins: dict[str, torch.Tensor], gpus: int) -> torch.Tensor:
    h = ins["x_g0"]
    rows = 16 // gpus
    for i in range(4):
        parts = [h @ w[f"w{i}"][j * rows : (j + 1) * rows].T @ ins[f"p{i}_g{j}"] for j in range(gpus)]
        h = sum(parts) * 0.1
    return h


# ---- sources -----------------------------------------------------------------------------------
def test_source_round_trips_and_bad_ones_are_refused(weights, tmp_path):
    path, _ = weights
    tg = chain(path, gpus=2)
    formats.save(tg, tmp_path / "g.json")
    back = formats.load_taskgraph(tmp_path / "g.json")
    assert back.vertices == tg.vertices and back.caller_inputs() == tg.caller_inputs()
    assert back["w1_g1"].source == Source(str(path), "w1", ((8, 16),))
    for bad, msg in [
        ({"path": "", "tensor": "w"}, "source.path"),
        ({"path": "f", "tensor": "w", "slices": [[3, 1]]}, "not a range"),
        ({"path": "f", "tensor": "w", "slices": [[0, True]]}, r"slices\[0\]"),
        ({"path": "f", "tensor": "w", "extra": 1}, "unknown field"),
        ("file.safetensors", "must be an object"),
    ]:
        doc = {
            "format": "disco-taskgraph",
            "version": 1,
            "gpus": 1,
            "vertices": [
                {"id": "w", "kind": "input", "gpu": 0, "shape": [1], "dtype": "float32", "source": bad}
            ],
            "outputs": [],
        }
        with pytest.raises(FormatError, match=msg):
            TaskGraph.from_dict(doc)


def test_reference_reads_sources_and_a_missing_tensor_is_named(weights):
    path, w = weights
    tg = chain(path, gpus=2)
    ins = chain_inputs(tg, 1)
    out = evaluate(tg, ins)[tg.outputs[0]]
    torch.testing.assert_close(out, expected(w, ins, 2))
    g = TaskGraph()
    g.output(g.scale(g.input("w", (16, 8), source=Source(str(path), "nope")), 2.0))
    with pytest.raises(RunError, match=r"input 'w'.*has no tensor 'nope'"):
        evaluate(g, {})
    g = TaskGraph()
    g.output(g.scale(g.input("w", (16, 9), source=Source(str(path), "w0")), 2.0))
    with pytest.raises(RunError, match=r"shape \[16, 8\], the input \[16, 9\]"):
        evaluate(g, {})


def test_a_sourced_input_is_not_handed_in(weights):
    path, _ = weights
    tg = chain(path)
    ins = chain_inputs(tg, 0)
    with pytest.raises(RunError, match="read from their source"):
        compile(tg, engine="local").run({**ins, "w0_g0": torch.zeros(16, 8)})


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("mode", ["roomy", "tight"])
def test_sourced_weights_run_and_later_runs_skip_loads_the_arena_still_holds(weights, gpus, mode):
    path, w = weights
    tg = chain(path, gpus)
    cap = None if mode == "roomy" else tight_capacity(tg)
    with compile(tg, cap, engine="local", order=list(tg.vertices)) as prog:
        for seed in range(3):
            ins = chain_inputs(tg, seed)
            out = prog.run(ins, check=True)[tg.outputs[0]]
            torch.testing.assert_close(out, expected(w, ins, gpus))
            skipped = sum(ex.statistics()["loads_skipped"] for ex in prog.engine.execs)
            if mode == "roomy":  # every weight stays in the arena after the first run
                assert skipped == (0 if seed == 0 else 4 * gpus)
                # the run summary counts only the loads that moved bytes: weights first, then none
                moved = prog.last_summary["bytes"].get("input", 0)
                caller = sum(v.nbytes for v in tg.caller_inputs())
                assert moved == (caller + 4 * 16 * 8 * 4 if seed == 0 else caller)
        reads = sum(s.bytes_read for s in prog.engine.pool.stores.values())
        assert reads == 4 * 16 * 8 * 4  # each worker read its own shards, once


def test_stable_loads_are_those_no_other_vertex_overwrites():
    def plan(value, off, n, kind=PlanKind.INPUT):
        return VertexPlan(kind, value, torch.empty(0), Loc(0, off, n))

    plans = {
        0: plan("a", 0, 16),  # alone
        1: plan("b", 16, 16),  # overwritten later by vertex 4
        2: plan("c", 64, 16),  # alone, but not the worker's own value (a caller input)
        3: plan("d", 96, 32),  # contains vertex 5's range
        4: plan("k", 24, 8, kind=1),
        5: plan("k2", 100, 4, kind=1),
        6: plan("e", 128, 0),  # empty
    }
    mg = MemGraph([256], [], [], {})
    assert stable_loads(mg, 0, plans, {"a", "b", "d", "e"}) == [0]


# ---- states and carry --------------------------------------------------------------------------
def counter(gpus: int = 1) -> TaskGraph:
    """s <- s + x on the last GPU, through a transfer; `carry` saves the sum as the next run's s."""
    g = TaskGraph(gpus=gpus)
    last = gpus - 1
    s = g.input("s", (4, 4), gpu=last, state=True)
    x = g.input("x", (4, 4), gpu=0)
    if gpus > 1:
        x = g.transfer(x, last, id="x_to")
    new = g.add(s, x, id="s_new")
    g.output(g.scale(new, 1.0, id="seen"))
    g.save_state(new, "s")
    return g


def test_carry_round_trips_and_is_checked():
    tg = counter(2)
    back = TaskGraph.from_dict(tg.to_dict())
    assert back.carry == {"s_new": "s"} and back["s"].state and back.kept == ["seen", "s_new"]
    g = TaskGraph()
    a = g.input("a", (2,), state=True)
    b = g.input("b", (3,))
    with pytest.raises(GraphError, match="carry 'nope'"):
        g.save_state("nope", "a")
    with pytest.raises(GraphError, match=r"state 'a' is \[2\]"):
        g.save_state(b, "a")
    g.save_state(a, "k")
    with pytest.raises(GraphError, match="saved by another value"):
        g.save_state(b, "k")
    with pytest.raises(GraphError, match="source or is a state"):
        g.input("c", (2,), source=Source("f", "t"), state=True)


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_plan_keeps_carried_values_and_the_verifier_checks_it(gpus):
    tg = counter(gpus)
    mg = build_memgraph(tg, max(min_capacity(tg)))
    assert set(mg.outputs) == {"seen", "s_new"}
    assert verify(tg, mg) == []
    broken = MemGraph(mg.capacity, mg.vertices, mg.edges, {"seen": mg.outputs["seen"]}, mg.host_capacity)
    assert any("carried value 's_new'" in v for v in verify(tg, broken))


@pytest.mark.parametrize("engine", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_states_persist_across_runs_and_programs_of_one_pool(engine, request):
    shared = request.getfixturevalue("pool") if engine == "ray" else LocalPool()
    tg = counter(2)
    reader = TaskGraph(gpus=2)
    reader.output(reader.scale(reader.input("s", (4, 4), gpu=1, state=True), 2.0, id="twice"))
    total = torch.zeros(4, 4)
    a = compile(tg, engine=engine, pool=shared)
    b = compile(reader, engine=engine, pool=shared)
    try:
        for k in range(3):
            x = torch.full((4, 4), float(k + 1))
            total += x
            out = a.run({"x": x})
            torch.testing.assert_close(out["seen"], total)
            assert set(out) == {"seen"}  # the carried value stays on the worker
            torch.testing.assert_close(b.run({})["twice"], 2 * total)
        torch.testing.assert_close(shared.read_state(1, "s", (4, 4), "float32"), total)
        shared.clear_states()
        torch.testing.assert_close(a.run({"x": torch.ones(4, 4)})["seen"], torch.ones(4, 4))
    finally:
        a.close()
        b.close()


def adder(name: str) -> TaskGraph:
    """state `name` <- itself + x, and its new value as the output."""
    g = TaskGraph()
    new = g.add(g.input(name, (4, 4), state=True), g.input("x", (4, 4)), id="new")
    g.output(g.scale(new, 1.0, id="seen"))
    g.save_state(new, name)
    return g


def test_moved_states_are_read_under_their_new_id_and_dropped_ones_free_their_place():
    """Renames between runs copy nothing; graphs already loaded read the moved value (never the
    arena's stale copy of the id's old value) and save to the moved state; a drop frees it."""
    shared = LocalPool()
    reader = TaskGraph()
    reader.output(reader.scale(reader.input("a", (4, 4), state=True), 2.0, id="twice"))
    progs = {n: compile(adder(n), engine="local", pool=shared, capacity=1 << 16) for n in "ab"}
    progs["read"] = compile(reader, engine="local", pool=shared, capacity=1 << 16)
    try:
        one, ten = torch.ones(4, 4), torch.full((4, 4), 10.0)
        progs["a"].run({"x": one})
        progs["b"].run({"x": ten})
        for _ in range(2):  # the second run skips the state's load: the arena holds it
            torch.testing.assert_close(progs["read"].run({})["twice"], 2 * one)
        assert shared.stores[0].loads_skipped == 1
        assert shared.stores[0].move_states({"b": "a", "a": "b"}) == {"moved": 2, "dropped": 0}
        torch.testing.assert_close(progs["read"].run({})["twice"], 2 * ten)  # b's value, under a
        torch.testing.assert_close(progs["a"].run({"x": one})["seen"], ten + one)
        torch.testing.assert_close(progs["b"].run({"x": one})["seen"], 2 * one)
        assert shared.move_states({}, ["a", "nothing"]) == [{"moved": 0, "dropped": 1}]
        assert shared.state_count() == [1]
        torch.testing.assert_close(progs["read"].run({})["twice"], 0 * one)  # a new zero state
    finally:
        for p in progs.values():
            p.close()


def test_a_state_of_another_size_is_refused():
    shared = LocalPool()
    with compile(counter(1), engine="local", pool=shared) as p:
        p.run({"x": torch.ones(4, 4)})
    g = TaskGraph()
    g.output(g.scale(g.input("s", (2, 2), state=True), 1.0))
    with (
        pytest.raises(RunError, match="state 's' holds 64 bytes"),
        compile(g, engine="local", pool=shared) as p,
    ):
        p.run({})


def test_a_pool_of_the_other_engine_is_refused():
    tg = counter(1)
    with pytest.raises(Exception, match="LocalPool cannot serve the ray engine"):
        Program(tg, build_memgraph(tg, 1 << 20), engine="ray", pool=LocalPool())


@pytest.mark.parametrize("engine", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_caller_inputs_left_out_are_the_ones_the_workers_hold(engine, request):
    """Weights handed in once: later runs leave them out, the workers use their copies (and, with
    room in the arena, skip loading them again); one passed again replaces the copy; after the
    workers are remade every input must be given again."""
    shared = request.getfixturevalue("pool") if engine == "ray" else LocalPool()
    g = TaskGraph(gpus=2)
    w0, w1 = g.input("w0", (8, 8), gpu=0), g.input("w1", (8, 8), gpu=1)
    x = g.input("x", (4, 8), gpu=0)
    h = g.matmul(x, w0, id="h")
    g.output(g.matmul(g.transfer(h, gpu=1, id="h1"), w1, id="y"))
    torch.manual_seed(0)
    weights = {"w0": torch.randn(8, 8), "w1": torch.randn(8, 8)}
    prog = compile(g, engine=engine, pool=shared)
    try:
        for k in range(3):
            xs = {"x": torch.randn(4, 8)}
            out = prog.run({**xs, **weights} if k == 0 else xs)
            torch.testing.assert_close(out["y"], evaluate(g, {**xs, **weights})["y"])
        skipped = sum(w["loads_skipped"] for w in prog.statistics()["engine"]["workers"])
        assert skipped == 2, f"the weights were loaded again ({skipped} loads skipped)"
        weights["w1"] = torch.randn(8, 8)
        out = prog.run({"x": xs["x"], "w1": weights["w1"]})
        torch.testing.assert_close(out["y"], evaluate(g, {**xs, **weights})["y"])
        prog.close()  # the workers' copies go with the engine
        with pytest.raises(RunError, match="input 'w0' is missing"):
            prog.run(xs)
    finally:
        prog.close()


# ---- sourced inputs read from their files at each load ------------------------------------------
def test_streamed_sources_read_row_and_column_blocks_in_any_file_dtype(tmp_path):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=gen)
    save_file({"a": w.to(torch.bfloat16), "b": w}, str(tmp_path / "w.safetensors"))
    path = str(tmp_path / "w.safetensors")
    g = TaskGraph()
    x = g.input("x", (3, 8))
    outs = []
    for n, (t, sl) in enumerate(
        [("a", ((8, 16), None)), ("b", ((0, 40), (16, 24))), ("b", ((33, 40),)), ("a", ((0, 8), (8, 16)))]
    ):
        rows = sl[0][1] - sl[0][0]
        cols = 24 if len(sl) < 2 or sl[1] is None else sl[1][1] - sl[1][0]
        v = g.input(f"w{n}", (rows, cols), source=Source(path, t, sl))
        outs.append(g.scale(v, 1.0, id=f"o{n}"))
    g.output(*outs, g.scale(x, 1.0, id="ox"))
    ins = {"x": torch.ones(3, 8)}
    want = evaluate(g, ins)
    for sources in ("host", "disk"):
        with compile(g, engine="local", sources=sources) as prog:
            got = prog.run(ins)
            st = prog.engine.execs[0].statistics()["store"]
        for k in want:
            torch.testing.assert_close(got[k], want[k], msg=f"{sources} {k}")
        if sources == "disk":
            assert st["resident_inputs"] == 0 and st["streamed"]["bytes_read"] >= (8 + 40 + 7 + 8) * 24 * 2
        else:
            assert st["resident_inputs"] == 4 and st["streamed"]["bytes_read"] == 0


@pytest.mark.parametrize("mode", ["roomy", "tight"])
def test_streamed_weights_give_the_same_outputs_and_are_read_at_each_load(weights, mode):
    path, w = weights
    tg = chain(path, 2)
    cap = None if mode == "roomy" else tight_capacity(tg)
    with compile(tg, cap, engine="local", order=list(tg.vertices), sources="disk") as prog:
        for seed in range(2):
            ins = chain_inputs(tg, seed)
            torch.testing.assert_close(prog.run(ins, check=True)[tg.outputs[0]], expected(w, ins, 2))
        read = sum(ex.store.reader.bytes for ex in prog.engine.execs)
    once = 4 * 16 * 8 * 4  # every weight once
    # roomy: the second run's loads are skipped (the arena holds them); tight: they are read again
    assert read >= once and (read < 2 * once) == (mode == "roomy")


def test_a_program_resized_frees_its_arena_and_computes_the_same(weights):
    path, w = weights
    tg = chain(path, 2)
    shared = LocalPool()
    with compile(tg, None, engine="local", order=list(tg.vertices), pool=shared) as prog:
        ins = chain_inputs(tg, 0)
        roomy = list(prog.mg.capacity)
        torch.testing.assert_close(prog.run(ins)[tg.outputs[0]], expected(w, ins, 2))
        r = prog.resize(tight_capacity(tg))
        assert r["capacity"] == [tight_capacity(tg)] * 2
        assert all(not s.arenas for s in shared.stores.values())  # freed before the next run
        torch.testing.assert_close(prog.run(ins, check=True)[tg.outputs[0]], expected(w, ins, 2))
        assert all(list(s.arenas) == [tight_capacity(tg)] for s in shared.stores.values())
        again = prog.resize(roomy)
        assert prog.mg.capacity == roomy and again["plan_s"] < r["plan_s"] + 1  # the kept plan
        torch.testing.assert_close(prog.run(ins)[tg.outputs[0]], expected(w, ins, 2))
