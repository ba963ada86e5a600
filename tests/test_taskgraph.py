"""TaskGraph builder and from_dict: every validation error names the vertex and the reason."""

from __future__ import annotations

import pytest

from disco_ray.graph.errors import FormatError, GraphError
from disco_ray.graph.taskgraph import Kind, TaskGraph


def doc(vertices, outputs=(), gpus=2) -> dict:
    return {
        "format": "disco-taskgraph",
        "version": 1,
        "gpus": gpus,
        "vertices": vertices,
        "outputs": list(outputs),
    }


def inp(id, gpu=0, shape=(4, 4), dtype="float32") -> dict:
    return {"id": id, "kind": "input", "gpu": gpu, "shape": list(shape), "dtype": dtype}


def test_builder_infers_shapes_and_order(tg2):
    assert [v.id for v in tg2] == ["x0", "w0", "m1", "t1"]
    assert tg2["m1"].kind is Kind.KERNEL and tg2["m1"].shape == (64, 64) and tg2["m1"].dtype == "float32"
    assert tg2["t1"].kind is Kind.TRANSFER and tg2["t1"].gpu == 1 and tg2["t1"].nbytes == 64 * 64 * 4
    assert tg2.outputs == ["t1"]
    assert tg2.consumers() == {"x0": ["m1"], "w0": ["m1"], "m1": ["t1"], "t1": []}
    tg2.validate()


def test_statistics(tg2):
    st = tg2.statistics()
    assert st["by_kind"] == {"input": 2, "kernel": 1, "transfer": 1}
    assert st["tensor_bytes_per_gpu"] == [3 * 16384, 16384]
    assert st["input_bytes"] == 2 * 16384


def test_kernel_defaults_to_first_operand_gpu_and_fresh_ids():
    g = TaskGraph(gpus=2)
    x = g.input("x", (8, 8), gpu=1)
    a = g.add(x, x)
    b = g.scale(a, 2.0)
    assert g[a].gpu == 1 and g[a].inputs == ("x", "x") and a != b
    assert g[b].attrs == {"factor": 2.0}
    assert g.consumers()["x"] == [a]  # add(x, x) reads x once


def test_batched_matmul_broadcasts():
    g = TaskGraph()
    a = g.input("a", (3, 1, 4, 5))
    b = g.input("b", (2, 5, 6))
    assert g[g.matmul(a, b)].shape == (3, 2, 4, 6)


def test_vertices_in_any_order_parse():
    g = TaskGraph.from_dict(
        doc(
            [
                {"id": "y", "kind": "kernel", "gpu": 0, "op": "add", "inputs": ["x", "x"]},
                inp("x"),
            ],
            outputs=["y"],
        )
    )
    assert [v.id for v in g] == ["x", "y"]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda g: (g.input("x", (2,)), g.input("x", (2,))), "vertex 'x': duplicate id"),
        (lambda g: g.add("nope"), "unknown input 'nope'"),
        (lambda g: g.kernel("conv9", g.input("x", (2,))), "vertex 'conv91': unknown op 'conv9'"),
        (
            lambda g: g.kernel("matmul", *(g.input(i, (2, 2)) for i in "xyz")),
            "op matmul takes 2 operands, got 3",
        ),
        (lambda g: g.kernel("matmul", g.input("x", (2, 2))), "op matmul takes 2 operands, got 1"),
        (lambda g: g.kernel("add"), "op add takes 1..n operands, got 0"),
        (
            lambda g: g.matmul(g.input("x", (2, 3)), g.input("y", (2, 3))),
            r"inner dims differ: \[2, 3\] @ \[2, 3\]",
        ),
        (lambda g: g.add(g.input("x", (2, 3)), g.input("y", (3, 2))), "do not broadcast"),
        (lambda g: g.add(g.input("x", (2,)), g.input("y", (2,), "float16")), "different dtypes"),
        (lambda g: g.softmax(g.input("x", (2,), "int32")), "needs a floating dtype, got int32"),
        (
            lambda g: g.transfer(g.input("x", (2,), gpu=1), gpu=1),
            "transfer of 'x' to gpu 1, where it already is",
        ),
        (lambda g: g.input("x", (2,), gpu=2), r"vertex 'x': gpu 2 out of range 0..1"),
        (lambda g: g.input("x", (2,), gpu=-1), "out of range"),
        (lambda g: g.transfer(g.input("x", (2,)), gpu=5), "gpu 5 out of range"),
        (
            lambda g: g.add(g.input("x", (2,), gpu=1), g.input("y", (2,))),
            "vertex 'add1': operand 'y' is on gpu 0, the kernel on gpu 1",
        ),
        (lambda g: g.kernel("scale", g.input("x", (2,))), "op scale needs attribute 'factor'"),
        (
            lambda g: g.kernel("scale", g.input("x", (2,)), factor=2.0, bias=1),
            r"has no attribute\(s\) \['bias'\]",
        ),
        (lambda g: g.input("x", (2,), dtype="float8"), "unknown dtype 'float8'"),
        (lambda g: g.input("x", (2, -1)), "dimension < 1"),
        (lambda g: g.input("x", (2.5,)), "shape must be a list of integers"),
        (lambda g: g.input("", (2,)), "non-empty string"),
        (lambda g: g.output("nope"), "output 'nope': no such vertex"),
        (lambda g: g.output(g.input("x", (2,)), "x"), "listed twice"),
    ],
)
def test_builder_errors(build, match):
    g = TaskGraph(gpus=2)
    with pytest.raises(GraphError, match=match):
        build(g)


@pytest.mark.parametrize("gpus", [0, -1, 1.5, True, "2", None])
def test_bad_gpu_count(gpus):
    with pytest.raises(GraphError, match="gpus must be a positive integer"):
        TaskGraph(gpus)


@pytest.mark.parametrize(
    ("vertices", "outputs", "error", "match"),
    [
        ([inp("x"), inp("x")], [], GraphError, "vertex 'x': duplicate id"),
        (
            [inp("x"), {"id": "y", "kind": "kernel", "gpu": 0, "op": "add", "inputs": ["q"]}],
            [],
            GraphError,
            "vertex 'y': unknown input 'q'",
        ),
        (
            [inp("x"), {"id": "y", "kind": "kernel", "gpu": 0, "op": "fft", "inputs": ["x"]}],
            [],
            GraphError,
            "vertex 'y': unknown op 'fft'",
        ),
        (
            [
                {"id": "a", "kind": "kernel", "gpu": 0, "op": "add", "inputs": ["b"]},
                {"id": "b", "kind": "kernel", "gpu": 0, "op": "add", "inputs": ["a"]},
            ],
            [],
            GraphError,
            "cycle a -> b -> a|cycle b -> a -> b",
        ),
        (
            [inp("x"), {"id": "s", "kind": "kernel", "gpu": 0, "op": "add", "inputs": ["x", "s"]}],
            [],
            GraphError,
            "cycle",
        ),
        (
            [inp("x"), {"id": "y", "kind": "kernel", "gpu": 0, "op": "matmul", "inputs": ["x"]}],
            [],
            GraphError,
            "vertex 'y': op matmul takes 2 operands, got 1",
        ),
        (
            [
                inp("x"),
                {"id": "y", "kind": "kernel", "gpu": 0, "op": "add", "inputs": ["x"], "shape": [4, 5]},
            ],
            [],
            GraphError,
            r"vertex 'y': stated shape \[4, 5\] but kernel gives \[4, 4\]",
        ),
        (
            [
                inp("x"),
                {"id": "y", "kind": "kernel", "gpu": 0, "op": "add", "inputs": ["x"], "dtype": "float16"},
            ],
            [],
            GraphError,
            "vertex 'y': stated dtype float16 but kernel gives float32",
        ),
        (
            [inp("x"), {"id": "t", "kind": "transfer", "gpu": 0, "inputs": ["x"]}],
            [],
            GraphError,
            "vertex 't': transfer of 'x' to gpu 0, where it already is",
        ),
        (
            [inp("x"), {"id": "t", "kind": "transfer", "gpu": 1, "inputs": ["x", "x"]}],
            [],
            GraphError,
            "exactly 1 input",
        ),
        ([inp("x", gpu=3)], [], GraphError, "vertex 'x': gpu 3 out of range 0..1"),
        (
            [{"id": "x", "kind": "input", "gpu": 0}],
            [],
            GraphError,
            "vertex 'x': an input needs shape and dtype",
        ),
        (
            [inp("x"), {"id": "y", "kind": "kernel", "gpu": 0, "op": "scale", "inputs": ["x"]}],
            [],
            GraphError,
            "vertex 'y': op scale needs attribute 'factor'",
        ),
        (
            [inp("x"), {"id": "y", "kind": "kernel", "gpu": 0, "op": "scale", "inputs": ["x"], "attrs": [1]}],
            [],
            FormatError,
            "vertex 'y': \"attrs\" must be an object",
        ),
        (
            [
                inp("x"),
                {"id": "y", "kind": "kernel", "gpu": 0, "op": "add", "inputs": ["x"], "attrs": {"k": 1}},
            ],
            [],
            GraphError,
            r"vertex 'y': op add has no attribute\(s\) \['k'\]",
        ),
        ([{"id": "x", "kind": "tensor"}], [], FormatError, "vertex 'x': unknown kind 'tensor'"),
        ([{"id": "x", "kind": ["input"]}], [], FormatError, "unknown kind"),
        ([{"kind": "input"}], [], FormatError, r"vertices\[0\] has no string \"id\""),
        ([7], [], FormatError, r"vertices\[0\] is not an object"),
        (
            [inp("x"), {"id": "y", "kind": "kernel", "gpu": 0, "op": "add", "inputs": "x"}],
            [],
            FormatError,
            '"inputs" must be a list of ids',
        ),
        ([inp("x", dtype=["float32"])], [], GraphError, "unknown dtype"),
        ([inp("x")], ["z"], GraphError, "output 'z': no such vertex"),
        ([inp("x")], [["x"]], GraphError, "no such vertex"),
    ],
)
def test_from_dict_errors(vertices, outputs, error, match):
    with pytest.raises(error, match=match):
        TaskGraph.from_dict(doc(vertices, outputs))


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ([], "top level must be an object"),
        ({"format": "disco-memgraph", "version": 1}, "\"format\" must be 'disco-taskgraph'"),
        ({"format": "disco-taskgraph", "version": 2}, "unsupported version 2"),
        ({"format": "disco-taskgraph", "version": 1, "gpus": 1, "vertices": {}}, '"vertices" must be a list'),
        (
            {"format": "disco-taskgraph", "version": 1, "gpus": 1, "vertices": [], "outputs": "x"},
            '"outputs" must be',
        ),
    ],
)
def test_from_dict_document_errors(d, match):
    with pytest.raises(FormatError, match=match):
        TaskGraph.from_dict(d)


def test_round_trip_keeps_everything(tg2):
    g = TaskGraph(gpus=1)
    x = g.input("x", (2, 8), "bfloat16")
    w = g.input("w", (8,), "bfloat16")
    g.output(g.rmsnorm(x, w, eps=1e-5, id="n"), g.transpose(x, id="tt"))
    for graph in (tg2, g):
        again = TaskGraph.from_dict(graph.to_dict())
        assert (
            again.vertices == graph.vertices and again.outputs == graph.outputs and again.gpus == graph.gpus
        )
    assert g["n"].attrs == {"eps": 1e-5, "offset": 0.0}  # every attribute, defaults filled in
