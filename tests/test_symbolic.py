"""Tests of planner.symbolic: random-order symbolic execution catches races and passes correct plans."""

from __future__ import annotations

import dataclasses
import random

import pytest

from disco_ray.graph.errors import VerifyError
from disco_ray.graph.memgraph import Loc
from planner.symbolic import check_random_orders, execute
from tests.memgraph_helpers import replaced
from tests.test_verify import g0, offload_graph, replace_vertex, transfer_graph, without_edge

SEED = 20261122


@pytest.mark.parametrize("build", [offload_graph, transfer_graph])
@pytest.mark.parametrize("in_flight", [1, 3, 8])
def test_correct_memgraph_runs_in_every_order(build, in_flight):
    tg, mg = build()
    check_random_orders(tg, mg, 200, SEED, in_flight=[in_flight])


def test_missing_memory_edge_is_caught():
    tg, mg = offload_graph()
    bad = without_edge(mg, 3, 4)  # the reload of y over x may land before z reads x
    with pytest.raises(VerifyError, match=r"vertex 3 .*expects 'x' from vertex 0 .*found 'y'.*seed"):
        check_random_orders(tg, bad, 200, SEED)


def test_missing_data_edge_is_caught():
    tg, mg = offload_graph()
    bad = without_edge(mg, 4, 5)  # o may read y's slot before the reload has filled it
    with pytest.raises(VerifyError, match=r"vertex 5 .*expects 'y' from vertex 4"):
        check_random_orders(tg, bad, 200, SEED)


def test_overlapping_execution_is_caught():
    # the kernel p writes over its own input o: caught in a single sequential run
    tg, mg = offload_graph()
    bad = replace_vertex(mg, dataclasses.replace(mg.vertices[7], out=g0(2)))
    with pytest.raises(
        VerifyError, match=r"vertex 7 .*on completion.*expects 'o'.*found 'p' half-written \(vertex 7"
    ):
        execute(tg, bad, random.Random(SEED))


def test_partial_overlap_is_caught():
    tg, mg = offload_graph()
    bad = replace_vertex(mg, dataclasses.replace(mg.vertices[3], out=Loc(0, 512, 1024)))
    with pytest.raises(VerifyError, match=r"expects 'x' from vertex 0 at gpu:0\[0:1024\]"):
        check_random_orders(tg, bad, 200, SEED)


def test_overwritten_output_is_caught():
    tg, mg = offload_graph()
    tg.output("y")  # y's kernel output (slot 1) is later overwritten by z and p
    with pytest.raises(
        VerifyError, match=r"output 'y' at gpu:0\[1024:2048\] \(vertex 1\): at the end found 'p'"
    ):
        execute(tg, replaced(mg, outputs={**mg.outputs, "y": 1}), random.Random(SEED))


def test_cycle_is_caught():
    tg, mg = offload_graph()
    with pytest.raises(VerifyError, match="never became ready"):
        execute(tg, replaced(mg, edges=[*mg.edges, (7, 1, "mem")]), random.Random(SEED))


def test_orders_differ():
    # a sanity check that random orders really vary: record start orders through a subclassed RNG
    tg, mg = transfer_graph()
    seen = set()
    for n in range(40):
        rng = random.Random(n)
        picks: list[int] = []
        orig = rng.randrange

        def spy(k, _orig=orig, _picks=picks):
            r = _orig(k)
            _picks.append(r)
            return r

        rng.randrange = spy
        execute(tg, mg, rng, in_flight=2)
        seen.add(tuple(picks))
    assert len(seen) > 1
