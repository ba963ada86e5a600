"""The main job end to end on the local engine (the ray engine runs in the README's ./run_demo.sh)."""

import json

from disco_ray.cli import demo
from disco_ray.graph import formats


def test_demo_plans_runs_and_checks(tmp_path, capsys):
    assert (
        demo.main(
            ["--engine", "local", "--backend", "cpu", "--workload", "matmul_chain", "--out", str(tmp_path)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "plan verified" in out and "outputs match the plain torch reference" in out
    mg = formats.load_memgraph(tmp_path / "demo.memgraph.json")
    # each GPU's arena holds about a third of its weights: they stream in and ranges are reused
    assert max(mg.stats["peak_gpu_bytes"]) <= max(mg.capacity) < 12 * 1024 * 512 * 4
    assert any(kind == "mem" for _, _, kind in mg.edges)
    trace = json.loads((tmp_path / "demo.trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
