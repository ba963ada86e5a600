"""The lane rule (actors/lanes.py): the stream layout, and a reading of each vertex that agrees
with the worker's own (actors/plans.py), which the executor and the simulator both take."""

from __future__ import annotations

import pytest
import torch

import workloads
from actors.backends.base import Mode
from actors.lanes import COPY_DEPTH, Lanes, Route, route
from actors.plans import PlanKind, Views
from disco_ray.graph.memgraph import HOST, MKind


def test_layout_of_the_lanes():
    plain = Lanes(5, (), False)
    assert (plain.h2d, plain.d2h, plain.total) == (5, 6, 7)
    assert plain.limits == (COPY_DEPTH, COPY_DEPTH)
    full = Lanes(4, (0, 2), True)
    assert full.peer == {0: 6, 2: 7} and full.deferred == 8 and (full.disk_w, full.disk_r) == (9, 10)
    assert full.limits == (COPY_DEPTH,) * 4 + (None, 1, 1) and full.total == 11
    assert [full.engine(s) for s in range(full.total)] == [Route.COMPUTE] * 4 + [
        Route.LOAD,
        Route.OFFLOAD,
        Route.TRANSFER,
        Route.TRANSFER,
        Route.TRANSFER,
        Route.SPILL,
        Route.UNSPILL,
    ]


def _expected(kind: int, out_device: int) -> Route:
    """The route the worker's plan kind implies (the executor's lanes before actors/lanes.py)."""
    if kind == PlanKind.COPY:
        return Route.OFFLOAD if out_device == HOST else Route.LOAD
    return {
        PlanKind.INPUT: Route.LOAD,
        PlanKind.RELOAD_INPUT: Route.LOAD,
        PlanKind.KERNEL: Route.COMPUTE,
        PlanKind.SPILL: Route.SPILL,
        PlanKind.UNSPILL: Route.UNSPILL,
        PlanKind.TRANSFER: Route.TRANSFER,
    }[kind]


@pytest.mark.parametrize("host_capacity", [None, 0])
def test_the_lane_rule_reads_vertices_as_the_worker_does(host_capacity):
    from planner import build_memgraph

    w = workloads.build("llama_prefill", materialize=False)
    tg = w.taskgraph
    mg = build_memgraph(tg, 64000, host_capacity=host_capacity)  # a tenth of what it holds
    seen = set()
    for g in range(mg.gpus):
        mine = [v for v in mg.vertices if v.gpu == g]
        host = max([v.out.end for v in mine if v.out.device == HOST] + [1])
        views = Views(
            g, mg, tg, torch.zeros(mg.capacity[g], dtype=torch.uint8), torch.zeros(host, dtype=torch.uint8)
        )
        lanes = Lanes.of(mg, g, 5)
        lane_of, mode = lanes.assign(mine, lambda src: Mode.LAUNCH)
        for v in mine:
            p = views.plan(v)
            assert route(v) is _expected(p.kind, p.out_loc.device), v
            seen.add(route(v))
            if p.kind == PlanKind.TRANSFER:
                assert lane_of[v.id] == lanes.peer[p.src_gpu]
            assert (v.id in lane_of) == (v.kind is not MKind.KERNEL)
        assert lanes.disk == (host_capacity == 0)
        assert {mode.get(v.id) for v in mine if route(v) in (Route.SPILL, Route.UNSPILL)} <= {Mode.BLOCKING}
        deferred, _ = lanes.assign(mine, lambda src: Mode.DEFERRED)
        assert {deferred[v.id] for v in mine if v.kind is MKind.TRANSFER} == {lanes.deferred}
    want = {Route.COMPUTE, Route.LOAD, Route.OFFLOAD, Route.TRANSFER}
    assert seen == (want if host_capacity is None else want - {Route.OFFLOAD} | {Route.SPILL, Route.UNSPILL})
