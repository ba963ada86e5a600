"""BUILDMEMGRAPH reloads exactly what Belady's MIN does for the same serial order (one tensor size).

planner.bounds computes MIN independently of the planner (a cache simulation per GPU, evicting
the value whose next request is furthest). With every tensor one size and capacities a whole
number of them, the planner must reach it on every random graph, order and capacity; with mixed
sizes the bound is a lower bound the planner may not beat.
"""

from __future__ import annotations

import random

import pytest

from planner import build_memgraph, default_order, min_capacity
from planner.bounds import min_reload_bytes
from planner.order import depth_first_order
from workloads.random_dag import random_dag

from .test_plan_properties import random_topo_order

SLOT = 32 * 32 * 4  # a float32 [32, 32]: every tensor of random_dag(..., sizes=(32,))


def case(seed: int):
    rng = random.Random(seed)
    gpus = rng.randint(1, 4)
    tg = random_dag(rng.randint(30, 160), gpus, seed, sizes=(32,), far_prob=rng.choice([0.05, 0.3]))
    least = max(min_capacity(tg)) // SLOT
    slots = rng.randint(least, least + 6)
    orders = {
        "default": None,
        "depth-first": depth_first_order(tg),
        "random": random_topo_order(tg, seed),
    }
    return tg, slots, orders


@pytest.mark.parametrize("seed", range(40))
def test_reloads_equal_belady_min_on_uniform_sizes(seed):
    tg, slots, orders = case(seed)
    for name, order in orders.items():
        mg = build_memgraph(tg, slots * SLOT, order=order)
        want = sum(min_reload_bytes(tg, slots * SLOT, order or default_order(tg, slots * SLOT)))
        got = mg.stats["bytes_reloaded"]
        assert got == want, (
            f"seed {seed}, {tg.gpus} GPU(s), {slots} slots, {name} order: the planner reloads "
            f"{got // SLOT} tensors, Belady's MIN {want // SLOT}"
        )


@pytest.mark.parametrize("seed", range(12))
def test_bound_is_a_lower_bound_for_mixed_sizes(seed):
    rng = random.Random(seed)
    tg = random_dag(rng.randint(40, 200), rng.randint(1, 3), seed, sizes=(8, 32, 128))
    cap = [m + rng.randint(0, 4) * 16384 for m in min_capacity(tg)]
    mg = build_memgraph(tg, cap)
    bound = sum(min_reload_bytes(tg, cap, default_order(tg, cap)))
    assert bound <= mg.stats["bytes_reloaded"], f"seed {seed}: bound {bound} above the plan's reloads"


def test_min_on_a_hand_made_chain():
    # x0 -> x1 -> ... with every weight y_i an input: with 3 slots nothing comes back; the kept
    # input x0 (an output too) is evicted along the way and must return at the end
    from disco_ray.graph.taskgraph import TaskGraph

    g = TaskGraph()
    x = g.input("x0", (32, 32))
    for i in range(4):
        x = g.matmul(x, g.input(f"y{i}", (32, 32)), id=f"x{i + 1}")
    g.output(x, "x0")
    order = list(g.vertices)
    assert min_reload_bytes(g, 3 * SLOT, order) == [SLOT]
    assert build_memgraph(g, 3 * SLOT, order=order).stats["bytes_reloaded"] == SLOT
    assert min_reload_bytes(g, 4 * SLOT, order) == [0]
