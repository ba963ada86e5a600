"""`run` and `bench` on a TaskGraph file of one's own with an inputs file; `--check-reference`,
`--progress`; one `--capacity` syntax on every command, and the message when it is rounded."""

from __future__ import annotations

import json

import pytest
import torch

from disco_ray.cli import main
from disco_ray.cli.app import build_parser, capacity_of
from disco_ray.cli.npz import load_npz, save_npz
from disco_ray.graph import formats
from disco_ray.graph.reference import evaluate
from disco_ray.graph.taskgraph import TaskGraph


def user_graph() -> TaskGraph:
    """Two GPUs: a layer-normed, bias-added GELU MLP whose hidden layer is split by columns."""
    g = TaskGraph(gpus=2)
    x = g.input("x", (32, 64))
    h = []
    for j in range(2):
        xj = x if j == 0 else g.transfer(x, 1, id="x@1")
        w, b = g.input(f"w1_{j}", (64, 64), gpu=j), g.input(f"b1_{j}", (64,), gpu=j)
        h.append(g.gelu(g.linear(g.layernorm(xj), w, b), "tanh"))
    y = g.concat(h[0], g.transfer(h[1], 0, id="h1@0"), axis=-1)
    g.output(g.add(g.linear(y, g.input("w2", (64, 128))), g.input("b2", (64,))))
    return g


@pytest.fixture
def files(tmp_path):
    g = user_graph()
    gen = torch.Generator().manual_seed(0)
    inputs = {v.id: torch.randn(v.shape, generator=gen) for v in g.caller_inputs()}
    formats.save(g, tmp_path / "mine.json")
    save_npz(str(tmp_path / "in.npz"), inputs)
    return g, inputs, tmp_path


def test_run_takes_a_taskgraph_file_and_its_inputs(files, capsys):
    g, inputs, d = files
    args = ["run", d / "mine.json", "--inputs", d / "in.npz", "--out", d / "out.npz", "--engine", "local"]
    rc = main(
        [
            *map(str, args),
            "--capacity",
            "64KiB",
            "--check-reference",
            "--progress",
            "--trace",
            str(d / "t.json"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    got = load_npz(str(d / "out.npz"))
    torch.testing.assert_close(got[g.outputs[0]], evaluate(g, inputs)[g.outputs[0]])
    assert "outputs match the reference" in err and "(cold: the plan's first run" in err
    assert "run: " in err and "vertices done (100%)" in err  # --progress without a terminal: lines
    trace = json.loads((d / "t.json").read_text())
    assert any(e["ph"] == "C" for e in trace["traceEvents"]) and trace["otherData"]["capacity"] == [
        65536,
        65536,
    ]


def test_check_reference_fails_the_run_with_one_line(files, capsys, monkeypatch):
    g, _inputs, d = files
    import disco_ray.graph.reference as reference

    real = reference.evaluate
    monkeypatch.setattr(reference, "evaluate", lambda tg, ins: {k: v + 1 for k, v in real(tg, ins).items()})
    args = ["run", d / "mine.json", "--inputs", d / "in.npz", "--out", d / "out.npz", "--engine", "local"]
    rc = main([*map(str, args), "--check-reference"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1].startswith(f"disco-ray: error: output {g.outputs[0]} differs from the reference")


def test_bench_takes_a_taskgraph_file_and_runs_every_mode_that_applies(files, capsys):
    _g, _inputs, d = files
    out = d / "bench"
    rc = main(
        ["bench", str(d / "mine.json"), "--inputs", str(d / "in.npz"), "--engine", "local", "--out", str(out)]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    doc = json.loads((out / "results.json").read_text())
    assert doc["workload"] == "mine.json" and doc["params"] == {"file": str(d / "mine.json")}
    # the runtime modes, levelwise by the graph's depths; no torch baseline for a file
    assert [r["mode"] for r in doc["modes"]] == ["dynamic", "deterministic", "levelwise", "in_memory"]
    assert all(r["check"]["ok"] for r in doc["modes"])
    assert (out / "timeline.png").exists() and (out / "trace.levelwise.json").exists()


def test_bench_never_reports_a_file_it_did_not_write(capsys, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    for stale in ("timeline.png", "trace.json", "trace.levelwise.json"):
        (out / stale).write_text("from an earlier bench")
    chain = ["matmul_chain", "n=2", "gpus=1", "tokens=8", "hidden=32"]
    rc = main(["bench", *chain, "--modes", "torch_naive", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]  # no run, no timeline nor trace
    wrote = [ln for ln in err.splitlines() if ln.startswith("wrote ")]
    assert wrote == [f"wrote {out / 'results.json'}"]


@pytest.mark.parametrize(
    "cmd",
    [
        ["plan", "g.json", "-o", "m.json"],
        ["run", "g.json", "--out", "o.npz"],
        ["bench", "g.json"],
        ["generate", "ckpt", "--prompt-ids", "1", "--max-new-tokens", "1", "--gpus", "2"],
        ["finetune", "ckpt", "--data", "d.npy", "--steps", "1", "--lr", "1e-4", "--gpus", "2", "--out", "a"],
    ],
    ids=lambda c: c[0],
)
def test_one_capacity_syntax_on_every_command(cmd):
    p = build_parser()
    for flags, want in (
        (["--capacity", "48KiB"], 49152),
        (["--capacity", "48KiB,32KiB"], [49152, 32768]),
        (["--capacity", "48KiB", "--capacity-gpu", "1=32KiB"], [49152, 32768]),
        (["--capacity", "1MB,1MiB", "--capacity-gpu", "0=2KiB"], [2048, 1 << 20]),
    ):
        assert capacity_of(p.parse_args([*cmd, *flags]), 2) == want, flags


def test_capacity_errors_and_the_rounding_message(cli, tmp_path):
    from tests.test_cli import assert_one_line_error

    r = cli("plan", "examples/chain.json", "--capacity", "49200,40000", "-o", tmp_path / "m.json")
    assert r.returncode == 0, r.stderr
    assert (
        "capacity of gpu 0 rounded down from 49200 to 49152 bytes (a multiple of the 256-byte alignment)"
        in r.stderr
    )
    assert "capacity of gpu 1 rounded down from 40000 to 39936 bytes" in r.stderr
    assert json.loads((tmp_path / "m.json").read_text())["devices"][1]["capacity"] == 39936
    r = cli("plan", "examples/chain.json", "--capacity", "48KiB,32KiB,16KiB", "-o", tmp_path / "x.json")
    assert_one_line_error(r, "--capacity gives 3 sizes for 2 GPU(s)")
    r = cli("plan", "examples/chain.json", "--capacity", "100", "-o", tmp_path / "x.json")
    assert_one_line_error(r, "whose capacity is 0 bytes (100 rounded down to the 256-byte alignment)")
    assert not (tmp_path / "x.json").exists()
