"""Issue 15: every bad input is refused with one line, every fault is named, no silent wrong answer.

The corpus below is generated per category (corrupted plans given to `run --plan`, bad op
attributes and shapes, bad input files, bad option values, bad workload parameters). Each case
runs the CLI in this process (`disco_ray.cli.main`: no interpreter start-up, no Ray) and asserts
exit 2, exactly one `disco-ray: error:` line naming the file and the vertex or field, no
traceback, and no output file (nor a temporary one beside it). A few cases run as a subprocess
too, as a user would. The fault cases (workers stopped or killed, SIGTERM) are at the end.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disco_ray.cli import main
from tests.conftest import ROOT, run_cli

NO_SHARED_RAY = True  # the --address cases must find no Ray running in this process

CHAIN = ROOT / "examples" / "chain.json"
CHAIN_DOC = json.loads(CHAIN.read_text())


@dataclass
class Case:
    """One bad input: `make(dir)` writes what it needs and returns the argv; the error line must
    contain every fragment ("{dir}" is replaced by the case's directory)."""

    id: str
    make: Callable[[Path], list[str]]
    fragments: tuple[str, ...]
    outputs: tuple[str, ...] = ("out.npz",)  # files (under dir) that must not exist afterwards
    tags: set[str] = field(default_factory=set)


def _write_json(path: Path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


# ---- 1. corrupted plans: `run --plan` verifies them against the TaskGraph first -----------------
def _chain_plan() -> dict:
    from disco_ray.graph import formats
    from planner import build_memgraph

    mg = build_memgraph(formats.load_taskgraph(CHAIN), 48 << 10)
    return mg.to_dict()


PLAN = _chain_plan()  # 13 vertices: offload, reloads of an intermediate and of an input, a transfer


def _reaches(edges, u: int, w: int) -> bool:
    succ: dict[int, list[int]] = {}
    for a, b, *_ in edges:
        succ.setdefault(a, []).append(b)
    todo, seen = [u], {u}
    while todo:
        x = todo.pop()
        if x == w:
            return True
        for y in succ.get(x, []):
            if y not in seen:
                seen.add(y)
                todo.append(y)
    return False


def _plan_mutations() -> list[tuple[str, dict, tuple[str, ...]]]:
    """(id, corrupted plan document, fragments) for every category of issue 15 item 1."""
    out = []
    verts = PLAN["vertices"]
    by_id = {v["id"]: v for v in verts}
    # a data edge removed where no other path orders its ends
    for n, (u, w, kind) in enumerate(PLAN["edges"]):
        rest = PLAN["edges"][:n] + PLAN["edges"][n + 1 :]
        if kind == "data" and not _reaches(rest, u, w):
            d = copy.deepcopy(PLAN)
            del d["edges"][n]
            out.append((f"edge-removed-{u}-{w}", d, (f"vertex {w}",)))
    # an output range moved onto a live input's range
    inputs = [v for v in verts if v["kind"] == "input"]
    for v in verts:
        if v["kind"] == "kernel" and v["device"] == "gpu:0":
            for x in inputs:
                if v["out"] != x["out"]:
                    d = copy.deepcopy(PLAN)
                    d["vertices"][verts.index(v)]["out"] = dict(x["out"])
                    out.append((f"output-on-input-{v['id']}-{x['value']}", d, ("vertex",)))
    # two inputs overlapping (the second moved onto the first, its readers too)
    for a in inputs:
        for b in inputs:
            if a is not b:
                d = copy.deepcopy(PLAN)
                loc = dict(a["out"])
                d["vertices"][verts.index(b)]["out"] = loc
                for r in d["vertices"]:
                    for i in r["ins"]:
                        if i["src"] == b["id"]:
                            i["loc"] = dict(loc)
                out.append((f"inputs-overlap-{b['value']}-on-{a['value']}", d, ("vertex",)))
    # a reload ordered before its offload
    for v in verts:
        if v["kind"] == "reload" and v["ins"][0]["src"] is not None:
            off = v["ins"][0]["src"]
            d = copy.deepcopy(PLAN)
            d["edges"] = [e for e in d["edges"] if e[:2] != [off, v["id"]]] + [[v["id"], off, "mem"]]
            out.append((f"reload-before-offload-{v['id']}", d, ("vert",)))
    # an output naming the wrong vertex
    for v in verts:
        if v["id"] != PLAN["outputs"][0]["vertex"]:
            d = copy.deepcopy(PLAN)
            d["outputs"][0]["vertex"] = v["id"]
            out.append((f"output-names-vertex-{v['id']}", d, ("out",)))
    # a read swapped to another value of the same size
    for v in verts:
        if v["kind"] == "kernel":
            for k, r in enumerate(v["ins"]):
                for x in verts:
                    if x["kind"] in ("kernel", "input") and x["value"] != r["value"] and x["id"] < v["id"]:
                        if x["out"]["device"] != v["device"]:
                            continue
                        d = copy.deepcopy(PLAN)
                        d["vertices"][verts.index(v)]["ins"][k] = {
                            "value": x["value"],
                            "src": x["id"],
                            "loc": dict(x["out"]),
                        }
                        out.append((f"read-swapped-{v['id']}.{k}-to-{x['value']}", d, ("vertex",)))
                        break
    # a vertex deleted (with its edges)
    for v in verts:
        if v["kind"] in ("kernel", "transfer", "input", "reload"):
            d = copy.deepcopy(PLAN)
            d["vertices"] = [x for x in d["vertices"] if x["id"] != v["id"]]
            d["edges"] = [e for e in d["edges"] if v["id"] not in e[:2]]
            d["outputs"] = [o for o in d["outputs"] if o["vertex"] != v["id"]] or d["outputs"]
            if all(o["vertex"] != v["id"] for o in d["outputs"]):
                out.append((f"vertex-deleted-{v['id']}", d, ("vertex",)))
    # a cycle: an edge back along a path
    for u, w, _ in PLAN["edges"][::3]:
        d = copy.deepcopy(PLAN)
        d["edges"].append([w, u, "mem"])
        out.append((f"cycle-{w}-{u}", d, ("cycle",)))
    # a sum-into mark forged onto a kernel of no `accumulate` vertex (to dodge the verifier), an edge removed
    d = copy.deepcopy(PLAN)
    d["vertices"][3]["accumulate"] = {"part": 0, "parts": 1}
    d["edges"] = [e for e in d["edges"] if e[:2] != [2, 3]]
    out.append(("vertex-forged-accumulate", d, ("vertex 3",)))
    # a host offload with its GPU's host capacity declared 0
    for g, dev in enumerate(PLAN["devices"]):
        if any(v["device"] == dev["device"] and v["out"]["device"] == "host" for v in verts):
            d = copy.deepcopy(PLAN)
            d["devices"][g]["host_capacity"] = 0
            out.append((f"host-capacity-zero-gpu{g}", d, (f"of {dev['device']}", "host store use of")))
    # a device more than the TaskGraph has GPUs
    d = copy.deepcopy(PLAN)
    d["devices"].append({"device": "gpu:2", "capacity": 49152, "host_capacity": 0})
    out.append(("extra-device", d, ("3 GPUs", "2")))
    assert {"edge", "output", "inputs", "reload", "read", "vertex", "cycle", "extra", "host"} <= {
        i.split("-")[0] for i, _, _ in out
    }
    del by_id
    return out


def _plan_case(name: str, doc: dict, frags: tuple[str, ...], trusted: bool = False) -> Case:
    def make(d: Path) -> list[str]:
        plan = _write_json(d / "bad.mem.json", doc)
        argv = ["run", str(CHAIN), "--plan", plan, "--out", str(d / "out.npz"), "--engine", "local"]
        return [*argv, "--timeout", "30"] + (["--trusted-plan"] if trusted else [])

    return Case(f"plan-{name}" + ("-trusted" if trusted else ""), make, ("bad.mem.json", *frags))


PLAN_CASES = [_plan_case(*m) for m in _plan_mutations()]
PLAN_CASES += [_plan_case(i, d, f, trusted=True) for i, d, f in _plan_mutations() if i.startswith("cycle")]


# ---- 2. TaskGraph attributes and shapes: refused when the graph is validated ---------------------
def _graph_with(vertex: dict, inputs: list[dict] | None = None) -> dict:
    base = [
        {"id": "x", "kind": "input", "gpu": 0, "shape": [8, 8], "dtype": "float32"},
        {"id": "y", "kind": "input", "gpu": 0, "shape": [8, 8], "dtype": "float32"},
    ]
    return {
        "format": "disco-taskgraph",
        "version": 1,
        "gpus": 1,
        "vertices": [*(inputs or base), {"kind": "kernel", "gpu": 0, **vertex}],
        "outputs": [vertex["id"]],
    }


NAN, INF = float("nan"), float("inf")
ATTR_BAD: list[tuple[str, list, str, list]] = [
    # op, operands, attribute, bad values
    ("concat", ["x", "y"], "axis", [1.5, "0", True, None, [0], 2, -3]),
    ("scale", ["x"], "factor", ["2", NAN, INF, -INF, True, [1.0], None]),
    ("rmsnorm", ["x", "y"], "eps", [-1e-6, NAN, "1e-6", INF]),
    ("layernorm", ["x"], "eps", [-1.0, NAN]),
    ("softmax", ["x"], "axis", [5, 0.5, "x"]),
    ("gelu", ["x"], "approximate", ["foo", 1, None]),
    ("cast", ["x"], "dtype", ["float128", 3, None]),
    ("add_scalar", ["x"], "value", [NAN, "1", True]),
    ("reshape", ["x"], "shape", [[-1, 8], "64", [64.0], [True, 64], [0, 64]]),
    ("permute", ["x"], "dims", [[0, 0], [0], "01", [0.0, 1.0]]),
    ("slice", ["x"], "stop", [1.5, "4", -100, 100]),
    ("sum", ["x"], "axes", [[5], "0", [0.5], 0]),
]
ATTR_FILL = {"slice": {"axis": 0, "start": 0, "stop": 4}, "sum": {"axes": [0]}, "rmsnorm": {}}


def _rmsnorm_operands(op: str) -> list[dict] | None:
    if op == "rmsnorm":  # x [8, 8] and its weight [8]
        return [
            {"id": "x", "kind": "input", "gpu": 0, "shape": [8, 8], "dtype": "float32"},
            {"id": "y", "kind": "input", "gpu": 0, "shape": [8], "dtype": "float32"},
        ]
    return None


def _attr_case(op: str, operands: list, attr: str, bad) -> Case:
    attrs = {**ATTR_FILL.get(op, {}), attr: bad}
    doc = _graph_with({"id": "k", "op": op, "inputs": operands, "attrs": attrs}, _rmsnorm_operands(op))

    def make(d: Path) -> list[str]:
        g = d / "g.json"
        g.write_text(json.dumps(doc))  # NaN and Infinity as Python's json writes them
        return ["plan", str(g), "--capacity", "1MiB", "-o", str(d / "out.json")]

    return Case(f"attr-{op}-{attr}-{bad!r}", make, ("g.json", "'k'", f"{attr}|{op}"), ("out.json",))


SHAPE_BAD = [
    [True, 8],
    [8, False],
    [0, 8],
    [8, 0],
    [1.5, 8],
    ["8", 8],
    [-1, 8],
    [None],
    [2**62, 2**62],
    [2**40, 2**20],
]


def _shape_case(shape) -> Case:
    doc = _graph_with(
        {"id": "k", "op": "relu", "inputs": ["x"]},
        [{"id": "x", "kind": "input", "gpu": 0, "shape": shape, "dtype": "float32"}],
    )

    def make(d: Path) -> list[str]:
        return ["plan", _write_json(d / "g.json", doc), "--capacity", "1MiB", "-o", str(d / "out.json")]

    return Case(f"shape-{shape!r}", make, ("g.json", "'x'", "shape"), ("out.json",))


def _huge_run_case() -> Case:
    # fits the validation limit but not this machine's memory: random inputs are refused up front
    doc = _graph_with(
        {"id": "k", "op": "relu", "inputs": ["x"]},
        [{"id": "x", "kind": "input", "gpu": 0, "shape": [2**20, 2**20], "dtype": "float32"}],
    )

    def make(d: Path) -> list[str]:
        return ["run", _write_json(d / "g.json", doc), "--out", str(d / "out.npz"), "--engine", "local"]

    return Case("run-huge-random-inputs", make, ("g.json", "'x'"))


def _nested_case(kind: str) -> Case:
    def make(d: Path) -> list[str]:
        (d / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
        if kind == "taskgraph":
            return ["plan", str(d / "deep.json"), "--capacity", "1MiB", "-o", str(d / "out.json")]
        if kind == "memgraph":
            return ["run", str(CHAIN), "--plan", str(d / "deep.json"), "--out", str(d / "out.npz")]
        return ["info", str(d / "deep.json")]

    return Case(f"nested-json-{kind}", make, ("deep.json", "nested"), ("out.json", "out.npz"))


GRAPH_CASES = [_attr_case(op, ins, a, b) for op, ins, a, bads in ATTR_BAD for b in bads]
GRAPH_CASES += [_shape_case(s) for s in SHAPE_BAD]
GRAPH_CASES += [_nested_case(k) for k in ("taskgraph", "memgraph", "info")]
GRAPH_CASES.append(_huge_run_case())


def _huge_intermediate_case() -> Case:
    # small inputs, a 16 GiB product: the arenas of a run on the cpu backend are refused up front
    doc = {
        "format": "disco-taskgraph",
        "version": 1,
        "gpus": 1,
        "vertices": [
            {"id": "a", "kind": "input", "gpu": 0, "shape": [2**17, 1], "dtype": "float32"},
            {"id": "b", "kind": "input", "gpu": 0, "shape": [1, 2**17], "dtype": "float32"},
            {"id": "c", "kind": "kernel", "gpu": 0, "op": "matmul", "inputs": ["a", "b"]},
            {"id": "d", "kind": "kernel", "gpu": 0, "op": "matmul", "inputs": ["c", "c"]},
        ],
        "outputs": ["d"],
    }

    def make(d: Path) -> list[str]:
        return ["run", _write_json(d / "g.json", doc), "--out", str(d / "out.npz"), "--engine", "local"]

    return Case("run-huge-intermediate", make, ("g.json", "host memory"))


GRAPH_CASES.append(_huge_intermediate_case())


# ---- 3. input files of `run` ------------------------------------------------------------------------
def _chain_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal((64, 64)).astype(np.float32) for k in ("x", "w")}


def _npz_bytes(arrays: dict) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _inputs_variants() -> list[tuple[str, Callable[[Path], None], str]]:
    good = _chain_inputs()
    whole = _npz_bytes(good)
    x = good["x"]

    def npz(arrays):
        return lambda p: p.write_bytes(_npz_bytes(arrays))

    return [
        ("truncated", lambda p: p.write_bytes(whole[: len(whole) // 2]), ""),
        ("truncated-tail", lambda p: p.write_bytes(whole[:-10]), ""),
        ("garbage", lambda p: p.write_bytes(b"\x00garbage" * 100), ""),
        ("empty", lambda p: p.write_bytes(b""), ""),
        ("text", lambda p: p.write_text("x,w\n1,2\n"), ""),
        ("npy", lambda p: np.save(p.open("wb"), x), ""),
        ("corrupt-member", lambda p: p.write_bytes(whole.replace(b"\x93NUMPY", b"\x93NUMPZ", 1)), ""),
        ("strings", npz({**good, "x": np.array([["a"] * 64] * 64)}), "'x'"),
        ("bytes", npz({**good, "x": np.array([[b"a"] * 64] * 64)}), "'x'"),
        ("structured", npz({**good, "x": np.zeros((64, 64), dtype=[("a", "f4"), ("b", "i4")])}), "'x'"),
        ("object", lambda p: np.savez(p, x=np.array([None] * 4, dtype=object), w=good["w"]), ""),
        ("complex", npz({**good, "x": x.astype(np.complex64)}), "'x'"),
        ("wrong-shape", npz({**good, "x": x[:32]}), "'x'"),
        ("wrong-dtype", npz({**good, "x": x.astype(np.float64)}), "'x'"),
        ("int-for-float", npz({**good, "x": x.astype(np.int32)}), "'x'"),
        ("missing", npz({"w": good["w"]}), "'x'"),
        ("extra", npz({**good, "zz": x}), "zz"),
        ("scalar", npz({**good, "x": np.float32(1.0)}), "'x'"),
        ("bfloat16-tag-garbage", npz({**good, "x.__dtype__": np.array("bfloat17")}), "x.__dtype__"),
    ]


def _inputs_case(name: str, write: Callable[[Path], None], frag: str) -> Case:
    def make(d: Path) -> list[str]:
        write(d / "in.npz")
        return [
            "run",
            str(CHAIN),
            "--inputs",
            str(d / "in.npz"),
            "--out",
            str(d / "out.npz"),
            "--engine",
            "local",
        ]

    return Case(f"inputs-{name}", make, ("in.npz", frag))


INPUT_CASES = [_inputs_case(*v) for v in _inputs_variants()]


# ---- 4. option values ---------------------------------------------------------------------------------
def _run(*extra: str, out: str = "out.npz") -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        return [
            "run",
            str(CHAIN),
            "--out",
            out.replace("{dir}", str(d)) if "{dir}" in out else str(d / out),
            "--engine",
            "local",
            *(e.replace("{dir}", str(d)) for e in extra),
        ]

    return make


def _unwritable(d: Path) -> Path:
    """A place no file can be made in, even by root (the tests may run as root): under a file."""
    ro = d / "ro"
    ro.write_text("a file, not a directory")
    return ro


def _run_into_unwritable(flag: str) -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        ro = _unwritable(d)
        if flag == "--out":
            return ["run", str(CHAIN), "--out", str(ro / "out.npz"), "--engine", "local"]
        return [*_run()(d), "--trace", str(ro / "t.json")]

    return make


def _plan_onto_itself(d: Path) -> list[str]:
    g = d / "g.json"
    g.write_text(CHAIN.read_text())
    return ["plan", str(g), "--capacity", "48KiB", "-o", str(g)]


OPTION_CASES = [
    Case("seed-2**70", _run("--seed", str(2**70)), ("--seed", str(2**70))),
    Case("seed-negative", _run("--seed", "-1"), ("--seed", "-1")),
    Case("streams-100000", _run("--streams", "100000"), ("--streams", "100000")),
    Case("streams-0", _run("--streams", "0"), ("--streams",)),
    Case("ahead-negative", _run("--ahead", "-1"), ("--ahead",)),
    Case("ahead-huge", _run("--ahead", "100000"), ("--ahead",)),
    Case("capacity-4400-digits", _run("--capacity", "9" * 4400), ("--capacity",)),
    Case(
        "capacity-4400-digits-gpu",
        _run("--capacity", "64KiB", "--capacity-gpu", "1=" + "9" * 4400),
        ("--capacity-gpu",),
    ),
    Case("capacity-tiny", _run("--capacity", "1KiB"), ("chain.json", "vertex")),
    Case("capacity-beyond-memory", _run("--capacity", "1000TiB"), ("chain.json", "host memory")),
    Case("capacity-gpu-out-of-range", _run("--capacity", "64KiB", "--capacity-gpu", "5=64KiB"), ("gpu 5",)),
    Case("timeout-negative", _run("--timeout", "-1"), ("--timeout", "-1")),
    Case("timeout-nan", _run("--timeout", "nan"), ("--timeout", "nan")),
    Case("timeout-inf", _run("--timeout", "inf"), ("--timeout", "inf")),
    Case("timeout-zero", _run("--timeout", "0"), ("--timeout",)),
    Case("delay-reversed", _run("--delay", "1,0"), ("delay",)),
    Case("delay-nan", _run("--delay", "nan,nan"), ("delay",)),
    Case("delay-inf", _run("--delay", "0,inf"), ("delay",)),
    Case("out-not-npz", _run(out="out.txt"), ("out.txt",), ("out.txt",)),
    Case("out-missing-dir", _run(out="{dir}/no/such/out.npz"), ("no/such/out.npz",)),
    Case("out-unwritable", _run_into_unwritable("--out"), ("ro/out.npz",)),
    Case("trace-unwritable", _run_into_unwritable("--trace"), ("ro/t.json",)),
    Case("trace-missing-dir", _run("--trace", "{dir}/no/such/t.json"), ("no/such/t.json",)),
    Case("plan-output-is-input", _plan_onto_itself, ("g.json", "-o")),
    Case("cpus-per-worker-negative", _run("--cpus-per-worker", "-1"), ("cpus",)),
    Case("gpus-per-worker-zero", _run("--gpus-per-worker", "0"), ("gpus",)),
    Case("gpus-per-worker-nan", _run("--gpus-per-worker", "nan"), ("gpus",)),
    Case("cpus-per-worker-nan", _run("--cpus-per-worker", "nan"), ("cpus",)),
    Case(
        "address-dead",
        _run("--address", "127.0.0.1:1", "--engine", "ray"),
        ("127.0.0.1:1", "nothing answers"),
    ),
    Case(
        "address-unresolvable",
        _run("--address", "no-such-host.invalid:6379", "--engine", "ray"),
        ("no-such-host",),
    ),
    Case(
        "bench-timeout-nan",
        lambda d: ["bench", str(CHAIN), "--timeout", "nan", "--out", str(d / "b")],
        ("--timeout",),
        ("b",),
    ),
    Case("generate-timeout-negative", lambda d: ["generate", str(d), "--timeout", "-1"], ("--timeout",), ()),
    Case(
        "finetune-seed-2**64",
        lambda d: ["finetune", str(d), "--seed", str(2**64), "--out", str(d / "a")],
        ("--seed",),
        ("a",),
    ),
    Case("plan-and-capacity", _run("--plan", "{dir}/x.json", "--capacity", "1MiB"), ("--plan",)),
    Case(
        "missing-taskgraph",
        lambda d: ["run", str(d / "nope.json"), "--out", str(d / "out.npz")],
        ("nope.json",),
    ),
    Case(
        "order-unknown-id",
        lambda d: [
            "plan",
            str(CHAIN),
            "--capacity",
            "1MiB",
            "--order",
            _write_json(d / "o.json", ["zz"]),
            "-o",
            str(d / "out.json"),
        ],
        ("zz",),
        ("out.json",),
    ),
    Case(
        "alignment-3",
        lambda d: ["plan", str(CHAIN), "--capacity", "1MiB", "--alignment", "3", "-o", str(d / "out.json")],
        ("3",),
        ("out.json",),
    ),
    Case(
        "alignment-huge",
        lambda d: [
            "plan",
            str(CHAIN),
            "--capacity",
            "1MiB",
            "--alignment",
            str(2**70),
            "-o",
            str(d / "out.json"),
        ],
        ("alignment",),
        ("out.json",),
    ),
    Case(
        "verify-limit-huge",
        lambda d: ["verify", str(CHAIN), str(d / "nope.json"), "--limit", "5"],
        ("nope.json",),
        (),
    ),
]


# ---- 5. workload parameters -----------------------------------------------------------------------------
WORKLOAD_BAD = [
    ("matmul_chain", "n=0"),
    ("matmul_chain", "n=-3"),
    ("matmul_chain", "gpus=0"),
    ("matmul_chain", "hidden=0"),
    ("matmul_chain", "tokens=-1"),
    ("matmul_chain", "hidden=1000000000"),
    ("matmul_chain", "n=100000000"),
    ("matmul_chain", "dtype=float128"),
    ("matmul_chain", "n=1.5"),
    ("tp_matmul", "m=0"),
    ("tp_matmul", "gpus=100000"),
    ("tp_matmul", "k=99999999999"),
    ("random_dag", "n=0"),
    ("random_dag", "transfer_prob=nan"),
    ("random_dag", "transfer_prob=2"),
    ("random_dag", "max_inputs=-1"),
    ("random_dag", "n=100000000"),
    ("llama_prefill", "preset=nope"),
    ("llama_prefill", "layers=0"),
    ("llama_prefill", "seq=0"),
    ("llama_prefill", "tile=0"),
    ("llama_prefill", "seq=10000000000"),
    ("llama_prefill", "heads=3"),
]


def _workload_case(name: str, param: str, cmd: str) -> Case:
    def make(d: Path) -> list[str]:
        if cmd == "run":
            return ["run", name, param, "--out", str(d / "out.npz"), "--engine", "local"]
        return ["workload", name, param, "-o", str(d / "out.json"), "--inputs", str(d / "out.npz")]

    return Case(f"workload-{cmd}-{name}-{param}", make, (name, param.split("=")[0]), ("out.npz", "out.json"))


WORKLOAD_CASES = [_workload_case(n, p, "workload") for n, p in WORKLOAD_BAD]
WORKLOAD_CASES += [_workload_case(n, p, "run") for n, p in WORKLOAD_BAD[::4]]

CORPUS = {
    "plan": PLAN_CASES,
    "graph": GRAPH_CASES,
    "inputs": INPUT_CASES,
    "options": OPTION_CASES,
    "workload": WORKLOAD_CASES,
}
ALL = [(cat, c) for cat, cs in CORPUS.items() for c in cs]


def test_the_corpus_is_large():
    assert len(ALL) >= 100, len(ALL)
    assert len({c.id for _, c in ALL}) == len(ALL)


def assert_refused(rc: int, err: str, d: Path, case: Case) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("disco-ray: error:")]
    assert rc == 2, (case.id, rc, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert len(lines) == 1, err[-2000:]
    assert err.rstrip().splitlines()[-1] == lines[0], err[-2000:]
    for f in case.fragments:  # "a|b": either
        alts = f.replace("{dir}", str(d)).split("|")
        assert any(a in lines[0] for a in alts), (case.id, f, lines[0])
    for o in case.outputs:
        assert not (d / o).exists(), (case.id, o)
    left = [p.name for p in d.rglob(".*") if p.is_file()]
    assert not left, (case.id, left)  # no temporary file beside an output
    return lines[0]


@pytest.mark.parametrize(("category", "case"), ALL, ids=[f"{cat}:{c.id}" for cat, c in ALL])
def test_bad_input_is_refused_with_one_line(category, case, tmp_path, capsys):
    if case.id.startswith("address-") and "ray" in sys.modules and sys.modules["ray"].is_initialized():
        pytest.skip("a Ray session of an earlier test is still up: --address would not be tried")
    d = tmp_path
    argv = case.make(d)
    capsys.readouterr()
    try:
        rc = main(argv)
    finally:
        for p in d.rglob("*"):
            if p.is_dir():
                p.chmod(0o700)
    err = capsys.readouterr().err
    assert_refused(rc, err, d, case)


@pytest.mark.parametrize(
    "case_id",
    ["plan-cycle-2-0-trusted", "inputs-npy", "attr-concat-axis-1.5", "nested-json-taskgraph", "seed-2**70"],
)
def test_a_few_cases_as_a_user_runs_them(case_id, tmp_path):
    """The same cases through `python -m disco_ray`: what a user sees, start-up included."""
    case = next(c for _, c in ALL if c.id == case_id)
    r = run_cli(*case.make(tmp_path)[0:])
    assert_refused(r.returncode, r.stderr, tmp_path, case)


def test_verify_refuses_a_plan_with_more_devices_than_gpus(tmp_path, capsys):
    _, doc, _ = next(m for m in _plan_mutations() if m[0] == "extra-device")
    plan = _write_json(tmp_path / "more.mem.json", doc)
    rc = main(["verify", str(CHAIN), plan])
    out = capsys.readouterr()
    assert rc == 1
    assert "the MemGraph has 3 devices, the TaskGraph 2 GPU(s)" in out.out


def test_a_trusted_plan_runs_unverified_but_a_correct_one_verified_runs(tmp_path, capsys):
    plan = _write_json(tmp_path / "ok.mem.json", PLAN)
    for extra in ([], ["--trusted-plan"]):
        argv = ["run", str(CHAIN), "--plan", plan, "--out", str(tmp_path / "out.npz"), "--engine", "local"]
        assert main([*argv, *extra]) == 0, capsys.readouterr().err
        assert (tmp_path / "out.npz").exists()
        (tmp_path / "out.npz").unlink()


# ---- fuzz: mutated TaskGraphs and MemGraphs are refused cleanly or computed right -----------------
FUZZ_VALUES = st.one_of(
    st.integers(-3, 3),
    st.sampled_from(
        [0, -1, 2**40, 2**70, 1.5, NAN, INF, -INF, True, False, None, "", "x", "float32", [], [0], [8, 8], {}]
    ),
)


def _fuzz_graph():
    from tests.runtime_helpers import random_taskgraph

    return random_taskgraph(5, n=12, gpus=2)


def _run_or_refuse(tg, mg=None) -> str:
    """Runs `tg` (with plan `mg`, else a tight plan of its own) on the local engine: "refused" for
    a DiscoError before or during the run, "ran" when the outputs equal the reference's."""
    import torch

    from disco_ray.driver.program import Program
    from disco_ray.graph.errors import DiscoError
    from disco_ray.graph.reference import evaluate, random_inputs
    from tests.runtime_helpers import tight_capacity

    try:
        if mg is None:
            from planner import build_memgraph

            mg = build_memgraph(tg, tight_capacity(tg))
        inputs = random_inputs(tg, 0)
        with Program(tg, mg, engine="local", streams=2) as prog:
            out = prog.run(inputs, timeout=30)
    except DiscoError:
        return "refused"
    want = evaluate(tg, inputs)
    assert set(out) == set(want)
    for k in want:
        torch.testing.assert_close(out[k], want[k], equal_nan=True)
    return "ran"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutated_taskgraphs(data):
    from disco_ray.graph.errors import DiscoError
    from disco_ray.graph.taskgraph import TaskGraph

    doc = _fuzz_graph().to_dict()
    v = data.draw(st.sampled_from(doc["vertices"]), label="vertex")
    key = data.draw(
        st.sampled_from(["shape", "dtype", "gpu", "inputs", "op", "attrs", "kind", "id"]), label="field"
    )
    if key == "attrs":
        v["attrs"] = {data.draw(st.sampled_from(["factor", "eps", "axis", "scale"])): data.draw(FUZZ_VALUES)}
    elif key == "shape" and isinstance(v.get("shape"), list) and v["shape"]:
        v["shape"][data.draw(st.integers(0, len(v["shape"]) - 1))] = data.draw(FUZZ_VALUES)
    elif key == "inputs" and v.get("inputs"):
        v["inputs"][0] = data.draw(st.sampled_from([x["id"] for x in doc["vertices"]] + ["nope"]))
    else:
        v[key] = data.draw(FUZZ_VALUES)
    try:
        tg = TaskGraph.from_dict(doc)
    except DiscoError:
        return
    _run_or_refuse(tg)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutated_memgraphs(data):
    from disco_ray.graph.errors import DiscoError
    from disco_ray.graph.memgraph import MemGraph
    from planner import build_memgraph
    from tests.runtime_helpers import tight_capacity

    tg = _fuzz_graph()
    doc = build_memgraph(tg, tight_capacity(tg)).to_dict()
    what = data.draw(st.sampled_from(["drop-edge", "flip-edge", "src", "offset", "output", "value", "field"]))
    verts = doc["vertices"]
    if what in ("drop-edge", "flip-edge"):
        n = data.draw(st.integers(0, len(doc["edges"]) - 1))
        e = doc["edges"].pop(n)
        if what == "flip-edge":
            doc["edges"].append([e[1], e[0], e[2]])
    elif what in ("src", "offset", "value"):
        reader = data.draw(st.sampled_from([v for v in verts if v["ins"]]))
        r = reader["ins"][data.draw(st.integers(0, len(reader["ins"]) - 1))]
        if what == "src":
            r["src"] = data.draw(st.sampled_from([v["id"] for v in verts] + [None, -1]))
        elif what == "offset":
            r["loc"]["offset"] = data.draw(st.sampled_from([0, 256, 512, 1024, r["loc"]["offset"] + 256]))
        else:
            r["value"] = data.draw(st.sampled_from([v["value"] for v in verts]))
    elif what == "output":
        doc["outputs"][0]["vertex"] = data.draw(st.sampled_from([v["id"] for v in verts]))
    else:
        v = data.draw(st.sampled_from(verts))
        v[data.draw(st.sampled_from(["kind", "device", "out", "id", "value"]))] = data.draw(FUZZ_VALUES)
    try:
        mg = MemGraph.from_dict(doc)
    except DiscoError:
        return
    _run_or_refuse(tg, mg)


# ---- faults of a whole CLI run: SIGTERM and SIGINT as a user's shell or a scheduler sends them ----
def _session_processes(sid: int) -> list[str]:
    """Command lines of the processes left in session `sid` (the run's, with its Ray)."""
    left = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    left.append((d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
            except (OSError, ValueError):
                continue
    return left


def _kill_gcs(proc) -> None:
    """SIGKILL to the GCS server of the run `proc` started (in its session)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == proc.pid and b"gcs_server" in (d / "cmdline").read_bytes():
                    os.kill(int(d.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize(
    ("sig", "rc", "word"),
    [
        (signal.SIGTERM, 143, "terminated"),
        (signal.SIGINT, 130, "interrupted"),  # on the local engine (Ctrl-C under Ray was fine already)
        ("gcs", 2, "GCS"),  # Ray's GCS killed: the heartbeat notices, the run ends naming it
    ],
)
def test_a_signal_ends_a_ray_run_with_one_line_and_nothing_left(sig, rc, word, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [
        "run",
        "random_dag",
        "n=40",
        "--out",
        str(tmp_path / "out.npz"),
        "--progress",
        "--delay",
        "0.1,0.1",
        *(["--engine", "local"] if sig == signal.SIGINT else []),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "disco_ray", *args],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own session: what it leaves behind is found by session id
        # Ctrl-C as at a terminal, even where this runs as a background job (which ignores SIGINT)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    t0 = time.monotonic()
    for line in proc.stderr:  # the run is under way once the first progress line comes
        lines.append(line)
        if line.startswith("run: ") or time.monotonic() - t0 > 120:
            break
    t = time.monotonic()
    if sig == "gcs":
        _kill_gcs(proc)
    else:
        proc.send_signal(sig)
    err = "".join(lines) + proc.stderr.read()
    got = proc.wait(timeout=60)
    took = time.monotonic() - t
    errors = [ln for ln in err.splitlines() if ln.startswith("disco-ray: error:")]
    assert got == rc, err[-3000:]
    assert len(errors) == 1 and word in errors[0] and "Traceback" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1] == errors[0], err[-3000:]
    assert took < 20, took
    assert not (tmp_path / "out.npz").exists()
    deadline = time.monotonic() + 15
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _session_processes(proc.pid)
