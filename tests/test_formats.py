"""JSON and msgpack documents: round trips, the FORMATS.md examples, and clear errors for bad files."""

from __future__ import annotations

import json

import msgpack
import pytest

from disco_ray.graph import formats
from disco_ray.graph.errors import FormatError, GraphError
from disco_ray.graph.memgraph import HOST, INPUT, Loc, MemGraph, MKind, Read
from disco_ray.graph.taskgraph import Kind, TaskGraph
from tests.conftest import sample_memgraph

# Verbatim from FORMATS.md.
FORMATS_TASKGRAPH = """
{
  "format": "disco-taskgraph", "version": 1,
  "gpus": 2,
  "vertices": [
    {"id": "x0", "kind": "input",    "gpu": 0, "shape": [64, 64], "dtype": "float32"},
    {"id": "w0", "kind": "input",    "gpu": 0, "shape": [64, 64], "dtype": "float32"},
    {"id": "m1", "kind": "kernel",   "gpu": 0, "op": "matmul", "inputs": ["x0", "w0"]},
    {"id": "t1", "kind": "transfer", "gpu": 1, "inputs": ["m1"]}
  ],
  "outputs": ["t1"]
}
"""

# Verbatim from FORMATS.md. It is an excerpt: vertex 1 (the load of w0) and 9 (t1) are left out.
FORMATS_MEMGRAPH = """
{
  "format": "disco-memgraph", "version": 1,
  "devices": [{"device": "gpu:0", "capacity": 1048576},
              {"device": "gpu:1", "capacity": 1048576}],
  "vertices": [
    {"id": 0, "kind": "input", "value": "x0", "device": "gpu:0", "ins": [],
     "out": {"device": "gpu:0", "offset": 0, "nbytes": 16384}},
    {"id": 2, "kind": "kernel", "value": "m1", "device": "gpu:0",
     "ins": [{"value": "x0", "src": 0, "loc": {"device": "gpu:0", "offset": 0, "nbytes": 16384}},
             {"value": "w0", "src": 1, "loc": {"device": "gpu:0", "offset": 16384, "nbytes": 16384}}],
     "out": {"device": "gpu:0", "offset": 32768, "nbytes": 16384}},
    {"id": 5, "kind": "offload", "value": "m1", "device": "gpu:0",
     "ins": [{"value": "m1", "src": 2, "loc": {"device": "gpu:0", "offset": 32768, "nbytes": 16384}}],
     "out": {"device": "host", "offset": 0, "nbytes": 16384}},
    {"id": 7, "kind": "reload", "value": "m1", "device": "gpu:0",
     "ins": [{"value": "m1", "src": 5, "loc": {"device": "host", "offset": 0, "nbytes": 16384}}],
     "out": {"device": "gpu:0", "offset": 0, "nbytes": 16384}}
  ],
  "edges": [[0, 2], [1, 2], [2, 5], [5, 7]],
  "outputs": [{"value": "t1", "vertex": 9}]
}
"""

W0 = {
    "id": 1,
    "kind": "input",
    "value": "w0",
    "device": "gpu:0",
    "ins": [],
    "out": {"device": "gpu:0", "offset": 16384, "nbytes": 16384},
}


@pytest.mark.parametrize("suffix", [".json", ".msgpack"])
def test_taskgraph_round_trip(tmp_path, tg2, suffix):
    path = tmp_path / f"g{suffix}"
    formats.save(tg2, path)
    again = formats.load_taskgraph(path)
    assert again.vertices == tg2.vertices and again.outputs == tg2.outputs and again.gpus == 2
    assert isinstance(formats.load_any(path), TaskGraph)
    if suffix == ".json":
        assert json.loads(path.read_text())["format"] == "disco-taskgraph"
    else:
        assert msgpack.unpackb(path.read_bytes())["format"] == "disco-taskgraph"


@pytest.mark.parametrize("suffix", [".json", ".msgpack", ".JSON"])
def test_memgraph_round_trip(tmp_path, suffix):
    mg = sample_memgraph()
    path = tmp_path / f"m{suffix}"
    formats.save(mg, path)
    again = formats.load_memgraph(path)
    assert again == mg
    assert again.to_dict() == mg.to_dict()
    assert isinstance(formats.load_any(path), MemGraph)
    assert again.vertex(6).ins[0].src is None and again.vertex(6).ins[0].loc.device == INPUT


def test_memgraph_equality_ignores_the_index_cache():
    a, b = sample_memgraph(), sample_memgraph()
    a.vertex(3)  # builds a's id -> position cache
    assert a == b


@pytest.mark.parametrize("suffix", [".json", ".msgpack"])
def test_planned_edges_are_columns_that_read_as_tuples(tmp_path, suffix):
    import pickle

    import numpy as np

    from disco_ray.graph.memgraph import Edges, edge_columns
    from planner import build_memgraph, tight_capacity
    from workloads.random_dag import random_dag

    tg = random_dag(80, 2, 1)
    mg = build_memgraph(tg, tight_capacity(tg, 0.2))
    e = mg.edges
    assert isinstance(e, Edges)
    tuples = list(e)
    assert all(type(u) is int and type(w) is int and k in ("data", "mem") for u, w, k in tuples)
    assert e == tuples and tuples == e[:] and e[3] == tuples[3] and e[-1] == tuples[-1] and tuples[0] in e
    assert e != tuples[:-1] and e != [*tuples[:-1], (0, 1, "mem")]
    assert [*e[:2], *e[3:]] == tuples[:2] + tuples[3:]
    assert edge_columns(tuples)[0].tolist() == e.u.tolist() and np.array_equal(edge_columns(tuples)[2], e.mem)
    assert pickle.loads(pickle.dumps(mg)) == mg
    st = mg.statistics()
    assert st["data_edges"] == sum(k == "data" for _, _, k in tuples) and st["edges"] == len(tuples)
    formats.save(mg, tmp_path / f"m{suffix}")
    back = formats.load_memgraph(tmp_path / f"m{suffix}")
    assert list(back.edges) == tuples and back == mg


def test_memgraph_document_fields():
    d = sample_memgraph().to_dict()
    assert d["devices"] == [
        {"device": "gpu:0", "capacity": 65536, "host_capacity": 16384, "disk_capacity": 0},
        {"device": "gpu:1", "capacity": 32768, "host_capacity": 0, "disk_capacity": 0},
    ]
    assert all(len(e) == 3 and e[2] in ("data", "mem") for e in d["edges"])
    assert d["stats"] == {"offloads": 1, "note": "x"}
    assert d["vertices"][3]["out"] == {"device": "host", "offset": 0, "nbytes": 16384}
    assert d["vertices"][6]["ins"] == [
        {"value": "x0", "src": None, "loc": {"device": "input", "offset": 0, "nbytes": 16384}}
    ]
    assert d["vertices"][7]["device"] == "gpu:1"
    assert d["outputs"] == [{"value": "t1", "vertex": 7}, {"value": "a1", "vertex": 4}]


def test_memgraph_statistics():
    st = sample_memgraph().statistics()
    assert st["by_kind"] == {"input": 2, "kernel": 2, "transfer": 1, "offload": 1, "reload": 2}
    assert (st["edges"], st["data_edges"], st["mem_edges"]) == (9, 6, 3)
    assert st["offloads"] == 1 and st["capacity"] == [65536, 32768]


def test_formats_md_taskgraph_example_parses(tmp_path):
    path = tmp_path / "example.json"
    path.write_text(FORMATS_TASKGRAPH)
    g = formats.load_taskgraph(path)
    assert [v.id for v in g] == ["x0", "w0", "m1", "t1"]
    assert g["m1"].shape == (64, 64) and g["t1"].kind is Kind.TRANSFER and g["t1"].gpu == 1
    assert g.outputs == ["t1"]


def test_formats_md_memgraph_example():
    doc = json.loads(FORMATS_MEMGRAPH)
    # as printed, the excerpt has an edge from vertex 1, which it leaves out
    with pytest.raises(FormatError, match=r"edge \[1, 2\] names an unknown vertex"):
        MemGraph.from_dict(doc)
    doc["vertices"].insert(1, dict(W0))
    mg = MemGraph.from_dict(doc)
    assert [v.id for v in mg] == [0, 1, 2, 5, 7]
    assert mg.capacity == [1048576, 1048576] and mg.host_capacity == [0, 0]
    assert mg.edges == [(0, 2, "data"), (1, 2, "data"), (2, 5, "data"), (5, 7, "data")]
    off, rel = mg.vertex(5), mg.vertex(7)
    assert off.kind is MKind.OFFLOAD and off.out == Loc(HOST, 0, 16384)
    assert rel.kind is MKind.RELOAD and rel.ins == (Read("m1", 5, Loc(HOST, 0, 16384)),)
    assert mg.vertex(2).ins[1] == Read("w0", 1, Loc(0, 16384, 16384))
    assert mg.outputs == {"t1": 9}
    assert MemGraph.from_dict(mg.to_dict()) == mg


def test_malformed_json_names_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "format": "disco-taskgraph",\n  "version": 1,,\n}')
    with pytest.raises(FormatError, match=r"bad\.json: malformed JSON at line 3 column 16"):
        formats.load_taskgraph(path)
    with pytest.raises(FormatError, match="line 3 column 16"):
        formats.load_any(path)


@pytest.mark.parametrize("data", [b"\xc1\xc1\xc1", msgpack.packb({(1, 2): 3}), msgpack.packb(1) + b"\x01"])
def test_malformed_msgpack(tmp_path, data):
    path = tmp_path / "bad.msgpack"
    path.write_bytes(data)
    with pytest.raises(FormatError, match=r"bad\.msgpack: malformed msgpack"):
        formats.load_memgraph(path)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("g.yaml", "unknown file suffix '.yaml'"),
        ("g", "unknown file suffix '\\(none\\)'"),
        ("missing.json", r"missing\.json: cannot read"),
    ],
)
def test_unreadable_files(tmp_path, name, match):
    with pytest.raises(FormatError, match=match):
        formats.load_taskgraph(tmp_path / name)


def test_graph_errors_name_the_file(tmp_path):
    doc = json.loads(FORMATS_TASKGRAPH)
    doc["vertices"][2]["inputs"] = ["x0", "nope"]
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(GraphError, match=r"g\.json: vertex 'm1': unknown input 'nope'"):
        formats.load_taskgraph(path)
    with pytest.raises(GraphError, match=r"g\.json: vertex 'm1'"):
        formats.load_any(path)


def test_wrong_document_kind(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(FORMATS_TASKGRAPH)
    with pytest.raises(FormatError, match="\"format\" must be 'disco-memgraph', got 'disco-taskgraph'"):
        formats.load_memgraph(path)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d["devices"][0].update(capacity="lots"), "malformed field"),
        (lambda d: d["devices"][0].update(device="cpu"), "bad device 'cpu'"),
        (lambda d: d["devices"][1].update(device="gpu:7"), "out of range"),
        (lambda d: d["vertices"][0].update(kind="compute"), "memgraph vertex 0: unknown kind 'compute'"),
        (lambda d: d["vertices"][0].update(id="0"), "id must be an integer"),
        (lambda d: d["vertices"][1].update(id=0), "memgraph vertex 0: duplicate id"),
        (lambda d: d["vertices"][0].update(device="host"), "runs on a GPU, not 'host'"),
        (lambda d: d["vertices"][0]["out"].update(offset=-5), "bad location"),
        (lambda d: d["vertices"][2]["ins"][0].update(src="zero"), '"src" must be a vertex id or null'),
        (lambda d: d["vertices"][2].pop("ins"), "missing or malformed field 'ins'"),
        (lambda d: d["edges"].append([0, 1, "maybe"]), r"bad edge \[0, 1, 'maybe'\]"),
        (lambda d: d["edges"].append([0]), r"bad edge \[0\]"),
        (lambda d: d["edges"].append([0, 42]), "names an unknown vertex"),
        (lambda d: d.update(version=9), "unsupported version 9"),
        (lambda d: d.update(stats=[1]), '"stats" must be an object'),
    ],
)
def test_memgraph_from_dict_errors(mutate, match):
    doc = json.loads(FORMATS_MEMGRAPH)
    doc["vertices"].insert(1, dict(W0))
    mutate(doc)
    with pytest.raises(FormatError, match=match):
        MemGraph.from_dict(doc)


def test_failed_write_leaves_no_file(tmp_path):
    path = tmp_path / "out.json"
    with pytest.raises(TypeError):
        formats.write_doc({"x": object()}, path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FormatError, match="unknown file suffix"):
        formats.write_doc({}, tmp_path / "out.txt")
    assert list(tmp_path.iterdir()) == []
