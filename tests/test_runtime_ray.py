"""The runtime on the `ray` engine (cpu backend, 4 logical GPUs): results under random orders."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from disco_ray.driver.program import Program
from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MKind, Read
from disco_ray.graph.reference import evaluate, random_inputs
from tests.ray_fixtures import pool  # noqa: F401  (module fixture)
from tests.runtime_helpers import MODES, plan, random_taskgraph
from tests.test_runtime_local import _corrupt_read, assert_same
from workloads.random_dag import random_dag

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("mode", MODES)
def test_random_graphs_match_reference_under_random_delays(pool, mode):  # noqa: F811
    for seed in range(3):
        tg = random_taskgraph(100 + seed, n=40, gpus=2 + seed % 3)
        with Program(tg, plan(tg, mode), engine="ray", pool=pool, streams=3) as prog:
            for run in range(2):
                inputs = random_inputs(tg, run)
                out = prog.run(inputs, check=True, delay=(0, 1e-3), seed=run, timeout=120)
                assert_same(out, evaluate(tg, inputs), (seed, run))


@pytest.mark.parametrize("ahead", [None, 2])
def test_workload_random_dags_with_tight_capacity(pool, ahead):  # noqa: F811
    """Also with launch ahead across Ray workers (the sanitizer checks every read under it)."""
    launched_ahead = 0
    for seed in range(3):
        tg = random_dag(80, 2 + seed % 2, seed)
        inputs = random_inputs(tg, seed)
        with Program(tg, plan(tg, "tight"), engine="ray", pool=pool, ahead=ahead) as prog:
            out = prog.run(inputs, check=True, delay=(0, 5e-4), seed=seed, timeout=120)
            launched_ahead += sum(w["launched_ahead"] for w in prog.statistics()["engine"]["workers"])
        assert_same(out, evaluate(tg, inputs), seed)
    assert (launched_ahead > 0) == (ahead is not None), launched_ahead  # cpu backend default: 0


def test_trace_has_every_gpu_and_vertex(pool, tmp_path):  # noqa: F811
    tg = random_taskgraph(11, n=30, gpus=3)
    mg = plan(tg, "tight")
    with Program(tg, mg, engine="ray", pool=pool) as prog:
        prog.run(random_inputs(tg, 0), trace=str(tmp_path / "t.json"), timeout=120)
        stats = prog.statistics()
    xs = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["args"]["vertex"] for e in xs) == [v.id for v in mg.vertices]
    assert {e["pid"] for e in xs} == {0, 1, 2}
    assert stats["engine"]["scheduler"]["state"] == "finished"
    assert sum(w["done"] for w in stats["engine"]["workers"]) == len(mg)


def test_sanitizer_checks_transfer_reads_on_the_source_worker(pool):  # noqa: F811
    tg = random_taskgraph(12, n=30, gpus=2)
    mg = plan(tg)

    def wrong_src(mg, v):  # a transfer claiming its source was written by the source GPU's first vertex
        r = v.ins[0]
        first = next(u.id for u in mg.vertices if u.gpu == r.loc.device)
        return Read(r.value, first, r.loc) if first != r.src else None

    for n, v in enumerate(mg.vertices):
        if v.kind is MKind.TRANSFER and (new := wrong_src(mg, v)) is not None:
            vs = list(mg.vertices)
            vs[n] = dataclasses.replace(v, ins=(new,))
            bad = dataclasses.replace(mg, vertices=vs, _index=None)
            # the edges still come from the real source, so the transfer runs after it and the
            # source worker's shadow names the real writer
            with (
                Program(tg, bad, engine="ray", pool=pool, trusted=True) as prog,  # verify refuses it
                pytest.raises(RunError, match=rf"sanitizer: vertex {v.id} \(transfer"),
            ):
                prog.run(random_inputs(tg, 0), check=True, timeout=120)
            return
    pytest.fail("no transfer to corrupt")


def test_sanitizer_on_a_kernel_read_under_ray(pool):  # noqa: F811
    tg = random_taskgraph(13, n=20, gpus=2)
    mg = plan(tg, "tight")
    bad, reader = _corrupt_read(
        mg, lambda mg, v: Read(v.ins[0].value, 0 if v.ins[0].src else 1, v.ins[0].loc)
    )
    with (
        Program(tg, bad, engine="ray", pool=pool, trusted=True) as prog,
        pytest.raises(RunError, match=f"vertex {reader}"),
    ):
        prog.run(random_inputs(tg, 0), check=True, timeout=120)


def test_bfloat16_outputs_come_back(pool):  # noqa: F811
    tg = random_taskgraph(14, n=15, gpus=2, dtype="bfloat16")
    inputs = random_inputs(tg, 0)
    with Program(tg, plan(tg, "tight"), engine="ray", pool=pool) as prog:
        out = prog.run(inputs, timeout=120)
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    assert_same(out, evaluate(tg, inputs))
