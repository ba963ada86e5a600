"""Traces and timelines: the occupancy counters and transfer flows of a run's trace, the packing of
concurrent slices into rows, the panels of any trace, and `disco-ray plot`."""

from __future__ import annotations

import itertools
import json
import random

import pytest

import disco_ray
import workloads
from disco_ray.bench.plot import pack, panel
from disco_ray.graph.trace import chrome_trace
from tests.test_cli import assert_one_line_error


@pytest.fixture(scope="module")
def tight_run():
    """llama_prefill tiny on 2 GPUs at 96 KiB in the builder's order: offloads, reloads, transfers, and
    inputs loaded early and evicted unread all happen."""
    w = workloads.build("llama_prefill", preset="tiny")
    res = disco_ray.run(
        w.taskgraph, w.inputs, capacity="96KiB", order=w.order(), engine="local", details=True
    )
    return res, chrome_trace(res.plan, res.records)


def test_arena_counters_stay_within_capacity_and_host_stores_fill(tight_run):
    res, doc = tight_run
    top: dict[tuple[int, str], int] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "C":
            key = (e["pid"], e["name"])
            top[key] = max(top.get(key, 0), e["args"]["bytes"])
    for g in range(2):
        # what the plan holds at once never exceeds the arena: the counters follow the plan
        assert 0.8 * res.plan.capacity[g] < top[(g, "arena bytes")] <= res.plan.capacity[g]
        assert top[(g, "host store bytes")] > 0  # offloads wrote the host store
    assert res.plan.stats["bytes_offloaded"] > 0


def test_every_transfer_has_one_flow_from_its_source(tight_run):
    _res, doc = tight_run
    ev = doc["traceEvents"]
    transfers = {e["args"]["vertex"]: e for e in ev if e["ph"] == "X" and e["cat"] == "transfer"}
    starts = {e["id"]: e for e in ev if e["ph"] == "s"}
    ends = {e["id"]: e for e in ev if e["ph"] == "f"}
    assert set(starts) == set(ends) == set(transfers) and transfers
    for vid, t in transfers.items():
        f = ends[vid]
        assert (f["pid"], f["tid"]) == (t["pid"], t["tid"]) and t["ts"] <= f["ts"] <= t["ts"] + t["dur"]
        assert starts[vid]["pid"] != f["pid"] and starts[vid]["ts"] <= f["ts"]


def test_pack_gives_concurrent_slices_rows_of_their_own():
    rng = random.Random(7)
    for _ in range(50):
        slices = [
            (s, s + rng.uniform(0.1, 3)) for s in (rng.uniform(0, 10) for _ in range(rng.randint(1, 30)))
        ]
        rows = pack(slices)
        assert sorted(x for row in rows for x in row) == sorted(slices)
        for row in rows:
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(row))  # none drawn over another
        # as few rows as the most slices running at one time
        depth = max(sum(s <= t < e for s, e in slices) for t, _ in slices)
        assert len(rows) == depth


FOREIGN = {
    "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "trainer"}},
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "dataloader"}},
        {"ph": "X", "name": "a", "cat": "io", "pid": 7, "tid": 1, "ts": 100, "dur": 50},
        {"ph": "X", "name": "b", "cat": "io", "pid": 7, "tid": 1, "ts": 120, "dur": 50},
        {"ph": "X", "name": "k", "cat": "kernel", "pid": 7, "tid": 2, "ts": 110, "dur": 10},
        {"ph": "C", "name": "memory", "pid": 7, "ts": 100, "args": {"bytes": 2048}},
        {"ph": "i", "name": "marker", "pid": 7, "ts": 130},
    ]
}


def test_a_foreign_trace_gets_its_lanes_by_category_or_thread():
    p = panel(FOREIGN, "other tool")
    assert [(name, lane, len(row)) for name, lane, row in p.rows] == [
        ("trainer compute", "compute", 1),  # the kernel category is known
        ("trainer dataloader", "dataloader", 1),  # the rest by thread; overlapping a, b: two rows
        ("dataloader +1", "dataloader", 1),
    ]
    assert p.counters == {"trainer memory": [(0.0, 2048.0)]} and p.span == pytest.approx(0.07)


def test_plot_command_draws_traces_and_refuses_what_it_cannot(cli, tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(FOREIGN))
    out = tmp_path / "t.png"
    r = cli("plot", tmp_path / "t.json", "-o", out, "--title", "mine")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and r.stderr.strip() == f"wrote {out}"
    (tmp_path / "bad.json").write_text("{")
    assert_one_line_error(cli("plot", tmp_path / "bad.json", "-o", tmp_path / "b.png"), "not a JSON trace")
    (tmp_path / "empty.json").write_text('{"traceEvents": []}')
    assert_one_line_error(
        cli("plot", tmp_path / "empty.json", "-o", tmp_path / "e.png"), "no slices and no counters"
    )
    assert_one_line_error(cli("plot", tmp_path / "t.json", "-o", tmp_path / "t.jpg"), "written as .png")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bad.json", "empty.json", "t.json", "t.png"]
