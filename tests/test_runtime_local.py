"""The runtime on the `local` engine (threads, one process): results, sanitizer, faults, trace, CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disco_ray.cli.npz import load_npz, save_npz
from disco_ray.cli.run import add_run
from disco_ray.driver.api import run_memgraph
from disco_ray.driver.program import Program
from disco_ray.graph.errors import RunError
from disco_ray.graph.formats import save
from disco_ray.graph.memgraph import Loc, MKind, Read
from disco_ray.graph.reference import evaluate, random_inputs
from disco_ray.graph.taskgraph import TaskGraph
from planner import build_memgraph
from tests.runtime_helpers import MODES, noop_op, plan, random_taskgraph, tight_capacity  # noqa: F401
from workloads.random_dag import random_dag

ENGINE = "local"


def assert_same(out, ref, seed=None):
    assert set(out) == set(ref)
    for k in ref:
        tol = 1e-5 if ref[k].dtype == torch.float32 else 2e-2
        assert out[k].dtype == ref[k].dtype, (k, seed)
        assert torch.allclose(out[k].float(), ref[k].float(), atol=tol, rtol=tol, equal_nan=True), (
            f"output {k!r}, seed {seed}"
        )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_random_graphs_match_reference_under_random_delays(seed, mode):
    tg = random_taskgraph(seed, n=30, gpus=1 + seed % 3)
    mg = plan(tg, mode)
    inputs = random_inputs(tg, seed)
    out = run_memgraph(tg, mg, inputs, engine=ENGINE, streams=3, check=True, delay=(0, 1e-3), seed=seed)
    assert_same(out, evaluate(tg, inputs), seed)


@pytest.mark.parametrize("seed", range(6))
def test_workload_random_dags_with_tight_capacity(seed):
    tg = random_dag(60, 1 + seed % 3, seed)
    mg = plan(tg, "tight")
    assert mg.statistics()["by_kind"]["offload"] + mg.statistics()["by_kind"]["reload"] > 0 or seed % 3 == 2
    inputs = random_inputs(tg, seed)
    out = run_memgraph(tg, mg, inputs, engine=ENGINE, check=True, delay=(0, 5e-4), seed=seed)
    assert_same(out, evaluate(tg, inputs), seed)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(dtype):
    tg = random_taskgraph(7, n=20, gpus=2, dtype=dtype)
    inputs = random_inputs(tg, 7)
    out = run_memgraph(tg, plan(tg, "tight"), inputs, engine=ENGINE, check=True)
    assert_same(out, evaluate(tg, inputs))


def test_program_runs_many_times_on_one_engine():
    tg = random_taskgraph(3, n=25, gpus=2)
    with Program(tg, plan(tg, "tight"), engine=ENGINE, streams=2) as prog:
        for seed in range(3):
            inputs = random_inputs(tg, seed)
            assert_same(prog.run(inputs, check=True, delay=(0, 3e-4), seed=seed), evaluate(tg, inputs), seed)
        assert prog.statistics()["last_run"]["vertices"] == len(prog.mg)


def _corrupt_read(mg, pick):
    """A copy of `mg` where the first kernel read `pick` accepts is redirected."""
    for n, v in enumerate(mg.vertices):
        if v.kind is MKind.KERNEL and v.ins:
            new = pick(mg, v)
            if new is not None:
                verts = list(mg.vertices)
                verts[n] = dataclasses.replace(v, ins=(new, *v.ins[1:]))
                return dataclasses.replace(mg, vertices=verts, _index=None), v.id
    raise AssertionError("nothing to corrupt")


def test_sanitizer_fires_on_a_read_of_the_wrong_range():
    tg = random_taskgraph(2, n=20, gpus=1)
    mg = plan(tg)

    def elsewhere(mg, v):  # read another value's range of the same size
        r = v.ins[0]
        for u in mg.vertices:
            if (
                u.gpu == v.gpu
                and u.out.device == v.gpu
                and u.out.nbytes == r.loc.nbytes
                and u.out != r.loc
                and u.id < v.id
            ):
                return Read(r.value, r.src, u.out)
        return None

    bad, reader = _corrupt_read(mg, elsewhere)
    with pytest.raises(RunError, match=rf"sanitizer: vertex {reader} .*expected the write of vertex"):
        run_memgraph(
            tg, bad, random_inputs(tg, 0), engine=ENGINE, check=True, trusted=True
        )  # verify refuses it


def test_sanitizer_fires_on_a_wrong_source():
    tg = random_taskgraph(4, n=20, gpus=1)
    mg = plan(tg, "tight")

    def wrong_src(mg, v):  # claim the value was written by another vertex (one that does run earlier)
        r = v.ins[0]
        return Read(r.value, 0 if r.src != 0 else 1, r.loc)

    bad, reader = _corrupt_read(mg, wrong_src)
    with pytest.raises(RunError, match=rf"sanitizer: vertex {reader} .* found vertex"):
        run_memgraph(
            tg, bad, random_inputs(tg, 0), engine=ENGINE, check=True, trusted=True
        )  # verify refuses it


def test_missing_or_wrong_inputs_are_refused_before_anything_runs():
    tg = random_taskgraph(1, n=10, gpus=2)
    prog = Program(tg, plan(tg), engine=ENGINE)
    good = random_inputs(tg, 0)
    name = next(iter(good))
    cases = [
        ({k: v for k, v in good.items() if k != name}, "missing"),
        ({**good, name: good[name][:1]}, "shape"),
        ({**good, name: good[name].double()}, "dtype"),
    ]
    for inputs, what in cases:
        with pytest.raises(RunError, match=what):
            prog.run(inputs)
    assert prog._engine is None  # refused before an engine (arenas, threads) was made


def noop_graph(fail_at: str | None = None, gpus: int = 2, n: int = 8) -> TaskGraph:
    """A chain of noop kernels hopping across GPUs through transfers; `fail_at` raises."""
    g = TaskGraph(gpus=gpus)
    prev = None
    for i in range(n):
        gpu = i % gpus
        ins = []
        if prev is not None:
            ins = [prev if g[prev].gpu == gpu else g.transfer(prev, gpu=gpu, id=f"t{i}")]
        prev = g.kernel("noop", *ins, gpu=gpu, id=f"n{i}", shape=[4], fail=f"n{i}" == fail_at)
    g.output(prev)
    return g


def test_a_kernel_that_raises_stops_the_run_naming_worker_and_vertex(noop_op):  # noqa: F811
    tg = noop_graph(fail_at="n5")
    mg = plan(tg)
    vid = next(v.id for v in mg.vertices if v.value == "n5")
    with pytest.raises(RunError, match=rf"gpu:1 vertex {vid} \(kernel 'n5'\) raised RuntimeError"):
        run_memgraph(tg, mg, {}, engine=ENGINE, timeout=60)


def test_trace_and_summary(tmp_path):
    tg = random_taskgraph(5, n=20, gpus=2)
    mg = plan(tg, "tight")
    path = tmp_path / "trace.json"
    with Program(tg, mg, engine=ENGINE) as prog:
        prog.run(random_inputs(tg, 0), trace=str(path))
        summary = prog.last_summary
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["args"]["vertex"] for e in xs) == sorted(v.id for v in mg.vertices)
    assert {e["pid"] for e in xs} == {0, 1}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    assert summary["vertices"] == len(mg) and summary["makespan_s"] > 0
    assert 0 < summary["gpus"][0]["busy_compute"] <= 1
    assert summary["bytes"]["offload"] == sum(v.out.nbytes for v in mg.vertices if v.kind is MKind.OFFLOAD)


def test_npz_round_trip_keeps_bfloat16(tmp_path):
    t = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.arange(6, dtype=torch.int64)}
    save_npz(str(tmp_path / "x.npz"), t)
    back = load_npz(str(tmp_path / "x.npz"))
    assert set(back) == {"a", "b"}
    assert back["a"].dtype == torch.bfloat16 and torch.equal(back["a"], t["a"])
    assert torch.equal(back["b"], t["b"])


def test_cli_run_local(tmp_path):
    tg = random_taskgraph(6, n=15, gpus=2)
    save(tg, tmp_path / "tg.json")
    inputs = random_inputs(tg, 1)
    np.savez(tmp_path / "in.npz", **{k: v.numpy() for k, v in inputs.items()})
    mg_path = tmp_path / "mg.json"
    save(plan(tg, "tight"), mg_path)
    parser = argparse.ArgumentParser()
    add_run(parser.add_subparsers())
    args = parser.parse_args(
        [
            "run",
            str(tmp_path / "tg.json"),
            "--inputs",
            str(tmp_path / "in.npz"),
            "--plan",
            str(mg_path),
            "--out",
            str(tmp_path / "out.npz"),
            "--engine",
            "local",
            "--check",
            "--trace",
            str(tmp_path / "t.json"),
            "--delay",
            "0,0.0005",
        ]
    )
    assert args.func(args) == 0
    assert_same(load_npz(str(tmp_path / "out.npz")), evaluate(tg, inputs))


def test_out_of_arena_plan_is_refused():
    tg = random_taskgraph(8, n=5, gpus=1)
    mg = plan(tg)
    v = mg.vertices[-1]
    verts = [*mg.vertices[:-1], dataclasses.replace(v, out=Loc(v.out.device, mg.capacity[0], v.out.nbytes))]
    with pytest.raises(RunError, match="outside the arena"):
        run_memgraph(
            tg,
            dataclasses.replace(mg, vertices=verts, _index=None),
            random_inputs(tg, 0),
            engine=ENGINE,
            trusted=True,  # the engine's own check, not the verifier's
        )


def test_top_level_run_and_compile_plan_with_the_real_planner():
    import disco_ray

    tg = random_dag(50, 2, 9)
    inputs = random_inputs(tg, 9)
    ref = evaluate(tg, inputs)
    assert_same(disco_ray.run(tg, inputs, capacity=tight_capacity(tg), engine=ENGINE, check=True), ref)
    with disco_ray.compile(tg, capacity=tight_capacity(tg), engine=ENGINE) as prog:
        assert prog.mg.statistics()["by_kind"]["offload"] > 0
        for seed in range(2):
            assert_same(prog.run(inputs, delay=(0, 2e-4), seed=seed, check=True), ref)
    with pytest.raises(RunError, match="missing"):
        disco_ray.run(tg, {}, engine=ENGINE)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    gpus=st.integers(1, 3),
    slack=st.integers(0, 8),
    streams=st.integers(1, 5),
    ahead=st.integers(0, 4),
)
def test_property_any_capacity_any_order_same_result(seed, gpus, slack, streams, ahead):
    """Between barely-fitting and roomy capacities, under random delays, with or without launch
    ahead, outputs match the reference and the sanitizer finds no race."""
    tg = random_dag(40, gpus, seed)
    mg = build_memgraph(tg, tight_capacity(tg) + slack * 4096)
    inputs = random_inputs(tg, seed)
    out = run_memgraph(
        tg, mg, inputs, engine=ENGINE, streams=streams, ahead=ahead, check=True, delay=(0, 3e-4), seed=seed
    )
    assert_same(out, evaluate(tg, inputs), (seed, gpus, slack, streams, ahead))


def chain_graph(n: int = 12) -> TaskGraph:
    """x -> silu -> scale -> silu ... on one GPU: every kernel waits on the one before."""
    g = TaskGraph(gpus=1)
    v = g.input("x", (16, 16))
    for i in range(n):
        v = g.silu(v, id=f"u{i}") if i % 2 == 0 else g.scale(v, 1.5, id=f"s{i}")
    g.output(v)
    return g


@pytest.mark.parametrize("ahead", [0, 1, 4])
def test_launch_ahead_queues_kernels_behind_running_ones(ahead):
    """Kernels of a chain are launched behind their running predecessor (waiting on it, checked by
    the sanitizer under random delays), at most `ahead` per stream; ahead=0 launches when ready."""
    tg = chain_graph()
    inputs = random_inputs(tg, 3)
    prog = Program(tg, plan(tg, "roomy"), engine=ENGINE, streams=2, ahead=ahead)
    with prog:
        out = prog.run(inputs, check=True, delay=(0, 2e-3), seed=ahead, trace=None)
        (ex,) = prog.engine.execs
        stats = ex.statistics()
    assert_same(out, evaluate(tg, inputs))
    kernels = sum(1 for v in prog.mg.vertices if v.kind is MKind.KERNEL)
    if ahead == 0:
        assert stats["launched_ahead"] == 0
    else:  # the chain's kernels all go behind their predecessor, on its stream
        assert stats["launched_ahead"] == kernels, stats
        assert {s for vid, s, *_ in ex.trace if vid != 0} == {0}, ex.trace
    assert max(ex.slots.depth) == 0 and not ex.slots.inflight


def test_completions_another_gpu_waits_for_are_reported_at_once_the_others_lazily(monkeypatch):
    """GPU 0 runs a long chain whose first vertex feeds GPU 1. With report calls so costly that
    lazy reports are held for up to 100 s (actors/reporter.py), GPU 0 reports its chain once,
    when idle, but the one completion GPU 1 waits for at once."""
    from actors.options import RunOptions, WorkerConfig
    from actors.reporter import Reporter
    from disco_ray.driver.engine_local import LocalEngine

    monkeypatch.setattr(Reporter, "timed", lambda self, seconds: setattr(self, "call_s", 100.0))
    g = TaskGraph(gpus=2)
    prev = g.input("x", (4, 8))
    chain = []
    for i in range(60):
        prev = g.rmsnorm(prev, id=f"c{i}")
        chain.append(prev)
    far = g.rmsnorm(g.transfer(chain[0], 1, id="to1"), id="far", gpu=1)
    g.output(prev, far)
    mg = build_memgraph(g, 1 << 20)
    eng = LocalEngine(g, mg, config=WorkerConfig(streams=1, lazy_s=100.0))
    try:
        inputs = random_inputs(g, 0)
        out, traces = eng.run(inputs, RunOptions(delay=(2e-3, 2e-3)))
        for k, want in evaluate(g, inputs).items():
            torch.testing.assert_close(out[k], want)
        ends = {mg.vertex(vid).value: t1 for vid, _, _, t1 in traces[0]}
        starts = {mg.vertex(vid).value: t0 for vid, _, t0, _ in traces[1]}
        assert starts["far"] < ends[chain[-1]], "GPU 1 waited for GPU 0's whole chain"
        reports = eng.statistics()["workers"][0]["reports"]
        assert reports <= 6, f"gpu:0 sent {reports} reports for a chain nobody else waits on"
    finally:
        eng.close()
