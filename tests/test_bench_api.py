"""`disco_ray.bench.run.bench` called from Python with plain arguments: no argparse, no CLI."""

from __future__ import annotations

import json

import pytest

import workloads
from disco_ray.bench import output
from disco_ray.bench.run import BenchResult, BenchSettings, bench
from disco_ray.graph.errors import UsageError

CHAIN = {"n": 4, "gpus": 2, "tokens": 16, "hidden": 64}
MODES = ("dynamic", "levelwise", "in_memory", "torch_naive")


def _chain(**kw):
    return workloads.build("matmul_chain", **{**CHAIN, **kw})


def test_bench_on_the_local_engine_checks_every_mode():
    w = _chain()
    res = bench(w, BenchSettings(modes=MODES, capacity=24 << 10, engine="local", warmup=0))
    assert isinstance(res, BenchResult)
    assert [r["mode"] for r in res.rows] == list(MODES)
    for r in res.rows:
        assert r["check"]["ok"] and r["check"]["max_rel_err"] <= r["check"]["tol"], r
        assert r["makespan_s"] > 0 and r["bytes_moved"] > 0
        assert r["speedup_vs_levelwise"] == pytest.approx(res.rows[1]["makespan_s"] / r["makespan_s"])
    assert res.mismatches() == []
    assert set(res.traces) == {"dynamic", "levelwise", "in_memory"}  # the runtime modes only
    assert res.traces["dynamic"]["otherData"]["mode"] == "dynamic"
    assert res.device.startswith("CPU") and res.bound["seconds"] is None
    assert res.ahead == 0 and res.cluster is None and res.unit == ("ms", 1e3)
    assert res.rows[0]["summary"]["plan"]["vertices"] > 0


def test_bench_reports_a_mode_whose_outputs_differ():
    w = _chain()
    real = w.reference
    wrong = type(w)(w.name, w.taskgraph, w.inputs, lambda ins: {k: v + 1 for k, v in real(ins).items()})
    res = bench(wrong, BenchSettings(modes=("dynamic",), capacity=24 << 10, engine="local", warmup=0))
    assert [r["mode"] for r in res.mismatches()] == ["dynamic"]
    assert not res.rows[0]["check"]["ok"]


@pytest.mark.parametrize("n", [2, 3])
def test_bench_simulated_needs_no_tensors(n):
    # DISCO §1: one weight block of room per GPU; levelwise takes 3n units, work-conserving 2n+1
    w = workloads.build("matmul_chain", n=n, gpus=2, tokens=4, hidden=128, materialize=False)
    res = bench(w, BenchSettings(capacity=48 << 10, simulate="unit"))
    rows = {r["mode"]: r for r in res.rows}
    assert list(rows) == ["dynamic", "deterministic", "levelwise", "in_memory"]  # no baseline simulated
    assert rows["dynamic"]["makespan_s"] == 2 * n + 1 and rows["levelwise"]["makespan_s"] == 3 * n
    assert all(r["check"] is None for r in res.rows)
    assert res.unit == ("units", 1.0) and res.profile == "unit" and res.bound["seconds"] == n


def test_the_result_written_from_python(tmp_path):
    w = _chain()
    settings = BenchSettings(modes=("dynamic", "levelwise"), capacity=24 << 10, engine="local")
    res = bench(w, settings)
    head = output.header(w, settings, res)
    assert head.splitlines()[1].startswith("capacity 24 KiB per GPU; cpu backend, local engine; device: CPU")
    written = output.write(tmp_path, w, settings, res, head)
    assert [p.name for p in written] == ["results.json", "trace.json", "trace.levelwise.json", "timeline.png"]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in doc["modes"]] == ["dynamic", "levelwise"]
    assert doc["engine"] == "local" and doc["warmup"] == 1 and doc["argv"] == []


@pytest.mark.parametrize(
    "settings, fragment",
    [
        (BenchSettings(repeat=0), "repeat must be >= 1"),
        (BenchSettings(modes=("dynamic", "fast")), "unknown mode(s) ['fast']"),
        (BenchSettings(simulate="tpu"), "unknown device profile 'tpu'"),
        (BenchSettings(order="random"), "unknown order 'random'"),
        (BenchSettings(modes=("torch_naive",), engine="local"), "no torch baseline for workload random_dag"),
    ],
)
def test_bench_refuses_settings_that_cannot_run(settings, fragment):
    with pytest.raises(UsageError) as e:
        bench(workloads.build("random_dag"), settings)
    assert fragment in str(e.value)
