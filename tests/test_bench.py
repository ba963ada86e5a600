"""`disco-ray workload` and `disco-ray bench` end to end on the CPU (small sizes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import workloads
from disco_ray.bench import report as bench
from disco_ray.cli import main
from disco_ray.cli.npz import load_npz
from tests.test_cli import assert_one_line_error

ALL = "dynamic,deterministic,levelwise,in_memory,torch_naive,torch_prefetch"
CHAIN = ["matmul_chain", "n=4", "gpus=2", "tokens=16", "hidden=64"]


def _bench(capsys, tmp_path, *args: str) -> tuple[int, str, dict]:
    out = tmp_path / "out"
    rc = main(["bench", *args, "--out", str(out)])
    text = capsys.readouterr().out
    doc = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    return rc, text, doc


def _one_line_error(capsys, rc: int, fragment: str) -> None:
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("disco-ray: error: "), err
    assert fragment in lines[0], (fragment, lines[0])


def _check_files(tmp_path, modes=("dynamic",)) -> None:
    """timeline.png, trace.json (dynamic) and trace.MODE.json of the other runtime modes, each with
    slices, occupancy counters, and a flow per transfer."""
    out = tmp_path / "out"
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    for m in modes:
        trace = json.loads((out / ("trace.json" if m == "dynamic" else f"trace.{m}.json")).read_text())
        ev = trace["traceEvents"]
        assert {"kernel", "input"} <= {e["cat"] for e in ev if e["ph"] == "X"}
        assert all(e["dur"] >= 0 for e in ev if e["ph"] == "X")
        assert {e["name"] for e in ev if e["ph"] == "C"} >= {"arena bytes"}
        transfers = sum(e["ph"] == "X" and e["cat"] == "transfer" for e in ev)
        assert sum(e["ph"] == "s" for e in ev) == sum(e["ph"] == "f" for e in ev) == transfers


@pytest.mark.parametrize(
    "args",
    [
        [*CHAIN, "--capacity", "24KiB"],  # 16 KiB weight blocks: one at a time, offloads happen
        ["llama_prefill", "preset=tiny", "--capacity", "160KiB"],
    ],
    ids=["matmul_chain", "llama_tiny"],
)
def test_bench_all_modes_local(capsys, tmp_path, args):
    rc, text, doc = _bench(capsys, tmp_path, *args, "--modes", ALL, "--engine", "local", "--warmup", "0")
    assert rc == 0, text
    modes = ALL.split(",")
    # the table: one line per mode, every one checked against the reference
    for m in modes:
        line = next(ln for ln in text.splitlines() if ln.startswith(m + " "))
        assert " ok (err " in line and "cold: the first run" in line, line
    assert "CPU" in text
    rows = {r["mode"]: r for r in doc["modes"]}
    assert list(rows) == modes
    assert doc["backend"] == "cpu" and doc["engine"] == "local" and doc["simulate"] is None
    assert doc["ahead"] == 0  # the cpu backend's default, written as used
    # no bound on the cpu backend: the column is left out and the note says why
    assert doc["lower_bound"]["seconds"] is None
    assert "/ bound" not in next(ln for ln in text.splitlines() if ln.startswith("mode "))
    assert "no lower bound on the cpu backend" in text
    for m, r in rows.items():
        assert r["makespan_s"] > 0 and r["check"]["ok"] and r["check"]["max_rel_err"] <= r["check"]["tol"]
        assert r["speedup_vs_levelwise"] == pytest.approx(rows["levelwise"]["makespan_s"] / r["makespan_s"])
        assert r["vs_bound"] is None
        assert r["bytes_moved"] > 0
        if not m.startswith("torch"):
            assert 0 < r["busy_compute"] <= 1
            assert r["summary"]["plan"]["vertices"] > 0
    # the planner had to offload for the small capacity; in_memory never does
    assert rows["in_memory"]["summary"]["bytes"].get("offload", 0) == 0
    _check_files(tmp_path, ("dynamic", "deterministic", "levelwise", "in_memory"))


@pytest.mark.ray
def test_bench_ray_two_workers_has_link_figures(capsys, tmp_path):
    rc, text, doc = _bench(
        capsys, tmp_path, *CHAIN, "--capacity", "24KiB", "--modes", "dynamic,levelwise", "--warmup", "0"
    )
    assert rc == 0, text
    assert doc["engine"] == "ray"
    links = doc["cluster"]["links"]
    assert {(ln["src"], ln["dst"]) for ln in links} == {(0, 1), (1, 0)}
    assert all(ln["gbps"] > 0 for ln in links)
    assert doc["modes"][0]["summary"]["placement"]["workers"]
    _check_files(tmp_path)


@pytest.mark.parametrize("n", [2, 5])
def test_bench_simulate_unit_reproduces_the_worked_example(capsys, tmp_path, n):
    # DISCO §1: one weight block of room per GPU; levelwise takes 3n units, work-conserving 2n+1
    args = ["matmul_chain", f"n={n}", "gpus=2", "tokens=4", "hidden=128", "--capacity", "48KiB"]
    rc, text, doc = _bench(capsys, tmp_path, *args, "--simulate", "unit", "--modes", ALL)
    assert rc == 0, text
    rows = {r["mode"]: r for r in doc["modes"]}
    assert rows["dynamic"]["makespan_s"] == 2 * n + 1
    assert rows["levelwise"]["makespan_s"] == 3 * n
    assert rows["dynamic"]["speedup_vs_levelwise"] == pytest.approx(3 * n / (2 * n + 1))
    assert rows["torch_naive"]["makespan_s"] is None and rows["torch_naive"]["note"] == "not simulated"
    assert doc["time_unit"] == "units" and doc["profile"] == "unit"
    assert "nothing ran, so no outputs were checked" in text
    assert all(r["check"] is None for r in doc["modes"])
    assert doc["lower_bound"]["seconds"] == n  # n weight loads per GPU, n matmuls per GPU
    _check_files(tmp_path)


def test_bench_simulate_h100_needs_no_tensors(capsys, tmp_path):
    # the GPU benchmark's shape: 16 fp16 8192^2 tiles, never materialized
    args = ["matmul_chain", "n=16", "gpus=1", "tokens=8192", "hidden=8192", "dtype=float16"]
    rc, text, doc = _bench(capsys, tmp_path, *args, "--capacity", "640MiB", "--simulate", "h100")
    assert rc == 0, text
    rows = {r["mode"]: r for r in doc["modes"]}
    assert rows["dynamic"]["makespan_s"] < rows["levelwise"]["makespan_s"]
    assert rows["dynamic"]["vs_bound"] >= 1.0  # the simulator cannot beat its own bound


def test_bench_mismatch_fails_naming_the_mode(capsys, tmp_path, monkeypatch):
    from workloads import baselines

    real = baselines.BASELINES["torch_naive"]

    def wrong(w, device=None):
        r = real(w, device)
        return baselines.BaselineResult(r.name, r.device, r.seconds, {k: v + 1 for k, v in r.outputs.items()})

    monkeypatch.setitem(baselines.BASELINES, "torch_naive", wrong)
    rc = main(["bench", *CHAIN, "--modes", "torch_prefetch,torch_naive", "--out", str(tmp_path / "o")])
    cap = capsys.readouterr()
    assert rc == 1
    assert "MISMATCH" in cap.out
    err = cap.err.strip().splitlines()[-1]
    assert err.startswith("disco-ray: error: mode torch_naive: output ") and "torch_prefetch" not in err


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["nope"], "unknown workload 'nope'"),
        ([*CHAIN, "--modes", "dynamic,fast"], "unknown mode(s) ['fast']"),
        ([*CHAIN, "bogus=1"], "has no parameter 'bogus'"),
        ([*CHAIN, "--simulate", "tpu"], "unknown device profile 'tpu'"),
        (["random_dag", "--modes", "torch_naive"], "no torch baseline for workload random_dag"),
        ([*CHAIN, "--repeat", "0"], "--repeat must be >= 1"),
        ([*CHAIN, "--streams", "0"], "--streams must be in 1..256, got 0"),
        ([*CHAIN, "--ahead", "-1"], "--ahead must be in 0..1024, got -1"),
    ],
)
def test_bench_usage_errors(capsys, tmp_path, args, fragment):
    out = tmp_path / "o"
    _one_line_error(capsys, main(["bench", *args, "--out", str(out)]), fragment)
    assert not out.exists()


# ---- disco-ray workload -----------------------------------------------------------------------------
def test_workload_list(cli):
    r = cli("workload", "--list")
    assert r.returncode == 0, r.stderr
    for name in workloads.names():
        assert any(ln.startswith(name + " ") for ln in r.stdout.splitlines()), r.stdout
    assert "n:int=4" in r.stdout and "preset:str=tiny" in r.stdout


def test_workload_writes_graph_and_inputs_that_run(cli, tmp_path):
    g, ins, outs = tmp_path / "g.msgpack", tmp_path / "in.npz", tmp_path / "out.npz"
    r = cli("workload", "llama_prefill", "preset=tiny", "dtype=bfloat16", "-o", g, "--inputs", ins)
    assert r.returncode == 0, r.stderr
    w = workloads.build("llama_prefill", preset="tiny", dtype="bfloat16")
    loaded = load_npz(str(ins))
    assert set(loaded) == set(w.inputs)
    for k, t in w.inputs.items():
        assert loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], t), k
    assert np.load(ins)[next(iter(w.inputs)) + ".__dtype__"] == "bfloat16"
    r = cli("run", g, "--inputs", ins, "--engine", "local", "--out", outs)
    assert r.returncode == 0, r.stderr
    got, ref = load_npz(str(outs)), w.reference(w.inputs)
    assert bench.check_outputs(got, ref)["ok"]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["nope", "-o", "g.json", "--inputs", "in.npz"], "unknown workload 'nope'"),
        (["matmul_chain", "n=x", "-o", "g.json", "--inputs", "in.npz"], "n='x' is not a valid int"),
        (["matmul_chain", "n", "-o", "g.json", "--inputs", "in.npz"], "bad workload parameter 'n'"),
        (["matmul_chain", "-o", "g.txt", "--inputs", "in.npz"], "unknown file suffix '.txt'"),
        (["matmul_chain", "-o", "g.json", "--inputs", "in.csv"], "written as .npz"),
        (["matmul_chain", "-o", "g.json"], "both -o GRAPH and --inputs IN.npz are required"),
        (["matmul_chain", "hidden=63", "-o", "g.json", "--inputs", "in.npz"], "not divisible by gpus 2"),
        (["matmul_chain", "-o", "no/such/g.json", "--inputs", "in.npz"], "cannot write"),
    ],
)
def test_workload_errors_write_nothing(capsys, tmp_path, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, main(["workload", *args]), fragment)
    assert list(tmp_path.iterdir()) == []


def test_workload_cli_subprocess_error(cli, tmp_path):
    r = cli("workload", "nope", "-o", tmp_path / "g.json", "--inputs", tmp_path / "in.npz")
    assert_one_line_error(r, "unknown workload 'nope'")
    assert list(tmp_path.iterdir()) == []


def test_check_outputs_tolerance_by_dtype():
    want = {"y": torch.ones(4, 4, dtype=torch.float16)}
    assert bench.check_outputs({"y": want["y"] * 1.01}, want)["ok"]  # fp16: 2e-2
    assert not bench.check_outputs({"y": want["y"].float() * 1.01}, {"y": want["y"].float()})["ok"]
    assert not bench.check_outputs({}, want)["ok"]
    assert bench.check_outputs({"y": torch.ones(3)}, want)["max_rel_err"] == float("inf")


def test_kernels_timed_alone_sum_per_gpu_and_count_only_kernels():
    from disco_ray.bench.bound import kernel_seconds_alone, lower_bound

    w = workloads.build("tp_matmul", gpus=2, m=64, k=64, n=64)
    secs = kernel_seconds_alone(w.taskgraph, "cpu", repeat=1)
    assert len(secs) == 2 and all(s > 0 for s in secs)  # each GPU has a partial product
    g = workloads.build("matmul_chain", n=1, gpus=1).taskgraph
    g.input("unused", (4, 4))
    assert kernel_seconds_alone(g, "cpu", repeat=1)[0] > 0
    b = lower_bound([0.5, 2.0], [1.0, 0.25], "given")
    assert b["seconds"] == 2.0 and [p["bound_s"] for p in b["per_gpu"]] == [1.0, 2.0]
