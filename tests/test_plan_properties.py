"""Property tests of the planner: random TaskGraphs -> build_memgraph -> verify -> symbolic execution.

Random DAGs over several GPUs with transfers, tensor sizes mixed by up to 1000x, long live ranges
and capacities down to the least any single vertex needs (forcing many offloads and reloads).
Every plan must verify clean and run in many random orders, overlapped ones included.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disco_ray.graph.errors import VerifyError
from disco_ray.graph.memgraph import MemGraph, MKind
from planner import build_memgraph, min_capacity, tight_capacity
from planner.order import random_order
from planner.symbolic import check_random_orders
from planner.verify import verify
from workloads.random_dag import random_dag

SIZES = [(16, 32, 64, 128), (8, 256), (4, 16, 128), (32,)]


def random_topo_order(tg, seed: int) -> list[str]:
    """A uniformly drawn ready vertex at each step: a valid but unfriendly serial order."""
    return random_order(tg, seed)


def plan_and_check(
    n: int,
    gpus: int,
    seed: int,
    fraction: float,
    sizes,
    orders: int = 20,
    *,
    shuffle: bool = False,
    lookahead: int | None = None,
    **kw,
):
    """Plans a random DAG at `fraction` of its tensor bytes; returns the MemGraph after all checks."""
    tg = random_dag(n, gpus, seed, sizes=sizes, **kw)
    cap = tight_capacity(tg, fraction)
    order = random_topo_order(tg, seed) if shuffle else None
    mg = build_memgraph(tg, cap, order=order, lookahead=lookahead)
    where = (
        f"random_dag({n}, {gpus}, {seed}, sizes={sizes}, {kw}) capacity {cap} (fraction {fraction}), "
        f"{'random' if shuffle else 'default'} order, lookahead {lookahead}"
    )
    msgs = verify(tg, mg)
    assert msgs == [], f"{where}: {msgs}"
    check_random_orders(tg, mg, orders, seed)
    return tg, mg


def moves(mg) -> tuple[int, int]:
    off = sum(1 for v in mg.vertices if v.kind is MKind.OFFLOAD)
    rel = sum(1 for v in mg.vertices if v.kind is MKind.RELOAD)
    return off, rel


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(8, 160),
    gpus=st.integers(1, 4),
    seed=st.integers(0, 2**31),
    fraction=st.sampled_from([0.0, 0.02, 0.1, 0.3, 2.0]),
    sizes=st.sampled_from(SIZES),
    transfer_prob=st.sampled_from([0.0, 0.1, 0.4]),
    far_prob=st.sampled_from([0.0, 0.05, 0.3]),
    shuffle=st.booleans(),
    lookahead=st.sampled_from([None, None, 0, 3]),
)
def test_random_plans_verify_and_run(
    n, gpus, seed, fraction, sizes, transfer_prob, far_prob, shuffle, lookahead
):
    n = max(n, 2 * gpus)
    plan_and_check(
        n,
        gpus,
        seed,
        fraction,
        sizes,
        transfer_prob=transfer_prob,
        far_prob=far_prob,
        shuffle=shuffle,
        lookahead=lookahead,
    )


@pytest.mark.parametrize("seed", range(6))
def test_tight_capacity_forces_offloads(seed):
    # at the floor capacity (the largest single vertex's need) long-lived values must leave the GPU
    tg, mg = plan_and_check(300, 3, seed, 0.0, (16, 64, 256), orders=10, far_prob=0.2)
    off, rel = moves(mg)
    assert rel > 0 and off > 0, f"seed {seed}: {off} offloads, {rel} reloads"
    assert mg.capacity == min_capacity(tg)
    # and with room for everything nothing moves
    roomy = build_memgraph(tg, tight_capacity(tg, 2.0))
    assert moves(roomy) == (0, 0) and verify(tg, roomy) == []


@pytest.mark.parametrize("seed", range(4))
def test_single_gpu_many_orders(seed):
    plan_and_check(120, 1, seed, 0.05, (16, 32, 64, 128), orders=100)


@pytest.mark.slow
def test_larger_plan_verifies():
    _, mg = plan_and_check(3000, 4, 7, 0.05, (16, 64, 256), orders=3)
    off, rel = moves(mg)
    assert off > 0 and rel > 0


@pytest.mark.parametrize("seed", range(3))
def test_verifier_and_executor_agree_on_mutants(seed):
    # drop one edge of a tight plan at a time: whenever random execution goes wrong the verifier
    # must have said so, and most flagged drops must show up in some execution
    tg, mg = plan_and_check(60, 2, seed, 0.0, (16, 32, 64, 128), orders=5, far_prob=0.2)
    rng = random.Random(seed)
    flagged = caught = 0
    for i in rng.sample(range(len(mg.edges)), min(20, len(mg.edges))):
        cut = MemGraph(
            mg.capacity, mg.vertices, mg.edges[:i] + mg.edges[i + 1 :], mg.outputs, mg.host_capacity
        )
        msgs = verify(tg, cut)
        try:
            check_random_orders(tg, cut, 60, seed)
        except VerifyError as e:
            assert msgs, f"seed {seed}: without edge {mg.edges[i]} the executor fails but verify passes: {e}"
            caught += 1
        flagged += bool(msgs)
    assert flagged > 0, f"seed {seed}: no dropped edge was needed"
    assert caught >= 0.75 * flagged, f"seed {seed}: executor caught {caught} of {flagged} flagged mutants"
