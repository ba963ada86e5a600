"""A plan split into parts, one forked process per group of GPUs (planner.split), equals the
one-process plan up to the order of offloads and reloads within a step; parts that fail or die
stop the plan with an error naming them."""

import os
import pickle
import threading
from collections import Counter

import pytest

from disco_ray.graph.errors import CapacityError, GraphError, PlanError
from disco_ray.graph.memgraph import MemGraph, MKind
from planner import build_memgraph, min_capacity, roomy_capacity, tight_capacity
from planner import split as split_mod
from planner.buildmemgraph import GroupError, Planner
from planner.symbolic import check_random_orders
from planner.verify import verify
from tests.test_sum_into import grads, random_sums
from workloads.random_dag import random_dag

AUX = (MKind.OFFLOAD, MKind.RELOAD)
SAME_STATS = (
    "bytes_offloaded",
    "bytes_reloaded",
    "peak_gpu_bytes",
    "peak_host_bytes",
    "peak_disk_bytes",
    "bytes_offloaded_disk",
    "bytes_reloaded_disk",
    "retractions",
    "compactions",
    "evictions",
    "clean_evictions",
    "superfluous_mem_edges",
    "mem_edges_built",
    "sum_into",
)


def canonical(mg: MemGraph):
    """The plan with every vertex named by (step of V, kind, value, location) instead of its id: an
    offload or reload sorts just before the vertex of its step, in an order the parts may change."""
    name, step = {}, 0
    for v in mg.vertices:
        key = (step, v.kind, v.value, v.gpu, v.out)
        name[v.id] = key
        if v.kind not in AUX:
            step += 1
    assert len(set(name.values())) == len(name)
    verts = {
        name[v.id]: (tuple((r.value, name.get(r.src), r.loc) for r in v.ins), v.acc) for v in mg.vertices
    }
    edges = Counter((name[u], name[w], k) for u, w, k in mg.edges)
    outputs = {k: name[v] for k, v in mg.outputs.items()}
    return verts, edges, outputs, mg.host_capacity, mg.disk_capacity


def same_plan(tg, cap, **kw):
    """Plans tg in one process and split in 2 and 3; asserts the plans are the same (edges unpruned)."""
    one = build_memgraph(tg, cap, window=0, workers=1, **kw)
    assert one.stats["planner_processes"] == 1
    want = canonical(one)
    for workers in (2, 3):
        mg = build_memgraph(tg, cap, window=0, workers=workers, **kw)
        assert mg.stats["planner_processes"] == min(workers, tg.gpus)
        got = canonical(mg)
        assert got[0] == want[0], "vertices differ"
        assert got[1] == want[1], "edges differ"
        assert got[2:] == want[2:], "outputs or host/disk sizes differ"
        for k in SAME_STATS:
            assert mg.stats.get(k) == one.stats.get(k), k
    return one


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("frac", [1.0, 0.3, 0.1])
def test_a_split_plan_is_the_one_process_plan(seed, frac):
    tg = random_dag(400, 4, seed, transfer_prob=0.3)
    cap = tight_capacity(tg, frac) if frac < 1 else [10**9] * 4
    one = same_plan(tg, cap)
    if frac == 0.1:
        assert one.stats["bytes_reloaded"] > 0  # the case moves data
    assert sum(v.kind is MKind.TRANSFER for v in one.vertices) > 10


@pytest.mark.parametrize("seed", range(3))
def test_a_split_plan_with_host_budget_spill_file_and_lookahead_is_the_same(seed):
    tg = random_dag(300, 4, seed, transfer_prob=0.3)
    same_plan(tg, tight_capacity(tg, 0.1), host_capacity=2**14)
    same_plan(tg, tight_capacity(tg, 0.2), lookahead=7)
    same_plan(tg, min_capacity(tg), fit="best")


@pytest.mark.parametrize("seed", range(6))
def test_split_plans_of_sums_and_transfers_of_sums_are_the_same(seed):
    tg = random_sums(seed)
    lo, hi = max(min_capacity(tg)), max(roomy_capacity(tg))
    for cap in sorted({lo, (lo + hi) // 2, hi}):
        try:
            same_plan(tg, cap)
        except CapacityError:
            continue


@pytest.mark.parametrize("seed", range(4))
def test_a_pruned_split_plan_verifies_and_runs_in_random_orders(seed):
    tg = random_dag(300, 4, seed, transfer_prob=0.3)
    mg = build_memgraph(tg, tight_capacity(tg, 0.15), workers=2)
    assert mg.stats["planner_processes"] == 2
    assert verify(tg, mg) == []
    check_random_orders(tg, mg, 6, seed)


def test_a_group_across_gpus_in_a_split_plan_verifies():
    tg = grads(6, 2)
    for cap in (1536, 4096):
        mg = build_memgraph(tg, cap, workers=2)
        assert mg.stats["planner_processes"] == 2 and verify(tg, mg) == []
        check_random_orders(tg, mg, 4, cap)


def _failing_run(fail):
    real = Planner.run

    def run(self, gpus=None, tag=0, parts=1):
        if tag == 1:
            fail()
        return real(self, gpus, tag, parts)

    return run


def test_an_error_in_a_part_stops_the_plan_with_it(monkeypatch):
    def fail():
        raise PlanError("planted failure in part 1")

    monkeypatch.setattr(Planner, "run", _failing_run(fail))  # inherited by the forked part
    tg = random_dag(200, 2, 0, transfer_prob=0.3)
    with pytest.raises(PlanError, match="planted failure in part 1"):
        build_memgraph(tg, tight_capacity(tg, 0.3), workers=2)


def test_a_part_that_dies_stops_the_plan_naming_it(monkeypatch):
    monkeypatch.setattr(Planner, "run", _failing_run(lambda: os._exit(3)))
    tg = random_dag(200, 2, 0, transfer_prob=0.3)
    with pytest.raises(PlanError, match=r"planner process for gpus \[1\] died \(exit code 3\)"):
        build_memgraph(tg, tight_capacity(tg, 0.3), workers=2)


def test_a_group_error_crosses_processes():
    e = pickle.loads(pickle.dumps(GroupError("in the way", [3, 5])))
    assert isinstance(e, GroupError) and e.groups == (3, 5) and str(e) == "in the way"


def test_parts_are_balanced_and_split_only_when_it_pays_and_is_safe(monkeypatch):
    gpu = [0] * 50 + [1] * 30 + [2] * 20 + [3] * 10
    assert split_mod.groups(gpu, 4, 2, 10) == [[0, 3], [1, 2]]
    assert split_mod.groups(gpu, 4, 1, 10) is None
    assert split_mod.groups(gpu, 4, 9, 10) == [[0], [1], [2], [3]]  # at most one part per GPU
    with pytest.raises(GraphError, match="workers must be 1 or more"):
        split_mod.groups(gpu, 4, 0, 10)
    monkeypatch.setattr(split_mod, "usable_cpus", lambda: 2)
    monkeypatch.setattr(split_mod, "fork_safe", lambda: True)
    big = split_mod.MIN_STEPS
    assert split_mod.groups(gpu, 4, None, big - 1) is None  # too short to gain
    assert split_mod.groups(gpu, 4, None, big) == [[0, 3], [1, 2]]
    monkeypatch.setattr(split_mod, "fork_safe", lambda: False)
    assert split_mod.groups(gpu, 4, None, big) is None
    assert split_mod.groups(gpu, 4, 2, big) == [[0, 3], [1, 2]]  # asked for: forked all the same


def test_forking_is_unsafe_while_another_thread_runs():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert not split_mod.fork_safe()
    finally:
        stop.set()
        t.join()
