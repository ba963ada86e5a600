"""Ablation modes only add edges: results stay acyclic, correct, and constrained as intended."""

from __future__ import annotations

import itertools

import pytest
import torch

import workloads
from disco_ray.bench import modes
from disco_ray.bench.profiles import UnitCost, h100, lane
from disco_ray.bench.simulate import simulate
from disco_ray.graph.errors import UsageError
from disco_ray.graph.memgraph import MKind
from tests.memgraph_helpers import execute_random_order, naive_memgraph


def _planner():
    try:
        from planner import build_memgraph
    except ImportError:
        pytest.skip("planner.build_memgraph is not on this branch yet")
    return build_memgraph


def _edges_by_value(mg):
    return {
        (mg.vertex(u).value, mg.vertex(u).kind, mg.vertex(w).value, mg.vertex(w).kind) for u, w, _ in mg.edges
    }


def _check_consistent(mg):
    """Ids dense and in list order, every edge forward, every read's source wrote that value."""
    assert [v.id for v in mg.vertices] == list(range(len(mg)))
    assert all(u < w for u, w, _ in mg.edges)
    for v in mg.vertices:
        for r in v.ins:
            assert r.src is None or mg.vertex(r.src).value == r.value
    for k, vid in mg.outputs.items():
        assert mg.vertex(vid).value == k


def test_deterministic_fixes_each_lane_order():
    w = workloads.build("llama_prefill", gpus=2, materialize=False)
    mg = naive_memgraph(w.taskgraph)
    det = modes.deterministic(mg)
    assert set(mg.edges) <= set(det.edges) and det.stats["order_edges"] > 0
    _check_consistent(det)
    r = simulate(det, w.taskgraph, h100)
    seen: dict = {}
    for v, g, ln, _s, _ in sorted(r.timeline, key=lambda e: (e[3], e[0])):
        seen.setdefault((g, ln), []).append(v)
    for ids in seen.values():
        assert ids == sorted(ids)
    per_gpu = modes.deterministic(mg, per="gpu")
    r1 = simulate(per_gpu, w.taskgraph, h100)
    for g in range(2):
        spans = sorted((s, e, v) for v, gg, _, s, e in r1.timeline if gg == g)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    with pytest.raises(UsageError):
        modes.deterministic(mg, per="stream")


def test_levelwise_runs_level_by_level():
    w = workloads.build("llama_prefill", gpus=2, layers=3, materialize=False)
    tg = w.taskgraph
    mg = naive_memgraph(tg)
    lw = modes.levelwise(mg, tg, w.levels)
    _check_consistent(lw)
    assert _edges_by_value(mg) <= _edges_by_value(lw)
    r = simulate(lw, tg, h100)
    lv = w.level_of()
    span: dict[int, list] = {}
    for vid, _, _, s, e in r.timeline:
        v = lw.vertex(vid)
        phase = 2 * lv[v.value] + (0 if v.kind is MKind.INPUT else 1)
        span.setdefault(phase, []).append((s, e))
    phases = sorted(span)
    for a, b in itertools.pairwise(phases):
        assert max(e for _, e in span[a]) <= min(s for s, _ in span[b]), (a, b)
    assert r.makespan >= simulate(mg, tg, h100).makespan
    # a mapping works as well as a list; unknown ids are refused
    assert len(modes.levelwise(mg, tg, lv).edges) == len(lw.edges)
    with pytest.raises(UsageError):
        modes.levelwise(mg, tg, {"nope": 0})


@pytest.mark.parametrize("seed", [0, 1])
def test_modes_keep_hand_made_plans_correct(seed):
    w = workloads.build("llama_prefill", gpus=2, seq=32, tile=8, layers=2, seed=seed)
    tg = w.taskgraph
    mg = naive_memgraph(tg)
    want = w.reference(w.inputs)
    for m in (mg, modes.deterministic(mg), modes.levelwise(mg, tg, w.levels)):
        got = execute_random_order(m, tg, w.inputs, seed=seed)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4, msg=f"seed {seed} {k}")


@pytest.mark.parametrize(
    ("name", "kw", "frac"),
    [
        ("matmul_chain", dict(n=5, gpus=2, tokens=8, hidden=64), 0.4),
        ("llama_prefill", dict(gpus=2, seq=16, tile=8, layers=2), 0.3),
        ("tp_matmul", dict(gpus=3, m=32, k=48, n=32), 0.6),
    ],
)
def test_modes_keep_planned_graphs_correct(name, kw, frac):
    build_memgraph = _planner()
    from planner.verify import verify

    w = workloads.build(name, **kw)
    tg = w.taskgraph
    need = max(tg.statistics()["tensor_bytes_per_gpu"])
    want = w.reference(w.inputs)
    variants = {}
    reloaded = 0
    for order in (None, w.order()):
        mg = build_memgraph(tg, int(need * frac) + 4096, order=order)
        reloaded += mg.stats["bytes_reloaded"]
        o = "planner" if order is None else "builder"
        variants |= {
            f"dynamic/{o}": mg,
            f"deterministic/{o}": modes.deterministic(mg),
            f"levelwise/{o}": modes.levelwise(mg, tg, w.levels),
        }
    assert reloaded > 0 or name != "llama_prefill", "the test wants a plan that offloads"
    variants["in_memory"] = modes.in_memory(tg)
    assert variants["in_memory"].statistics()["by_kind"]["offload"] == 0
    for mode, m in variants.items():
        _check_consistent(m)
        assert verify(tg, m) == [], mode
        simulate(m, tg, UnitCost())
        for seed in range(2):
            got = execute_random_order(m, tg, w.inputs, seed=seed)
            for k in want:
                torch.testing.assert_close(
                    got[k], want[k], rtol=1e-4, atol=1e-4, msg=f"{mode} seed {seed} {k}"
                )


def test_plan_dispatches_modes():
    build_memgraph = _planner()
    w = workloads.build("matmul_chain", n=3, gpus=2, tokens=4, hidden=32, materialize=False)
    cap = 64 * 1024
    assert len(modes.plan(w.taskgraph, "dynamic", cap).edges) == len(build_memgraph(w.taskgraph, cap).edges)
    assert modes.plan(w.taskgraph, "levelwise", cap, levels=w.levels).stats["mode"] == "levelwise"
    assert modes.plan(w.taskgraph, "deterministic", cap).stats["mode"] == "deterministic/lane"
    with pytest.raises(UsageError):
        modes.plan(w.taskgraph, "levelwise", cap)
    with pytest.raises(UsageError):
        modes.plan(w.taskgraph, "fast", cap)


def test_lane_of_every_kind():
    w = workloads.build("matmul_chain", n=2, gpus=2, tokens=4, hidden=8, materialize=False)
    mg = naive_memgraph(w.taskgraph)
    assert {lane(v) for v in mg.vertices} == {"h2d", "compute", "peer"}
