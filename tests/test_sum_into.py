"""Sum-into accumulation (TURNIP appendix A): an `accumulate`'s kernels, one per operand, add into
one range in any order, one at a time; the worker core's write lock and the runtime."""

from __future__ import annotations

import pytest
import torch

from actors.worker_core import WorkerCore
from disco_ray.driver.program import Program
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.reference import evaluate
from disco_ray.graph.taskgraph import TaskGraph
from planner import build_memgraph
from tests.memgraph_helpers import execute_random_order, naive_memgraph, replaced


def grads(n: int = 5, gpus: int = 1) -> TaskGraph:
    """n partials (each a product of two inputs), their accumulate, and a reader of the sum."""
    g = TaskGraph(gpus)
    parts = []
    for k in range(n):
        j = k % gpus
        a, b = g.input(f"a{k}", (4, 4), gpu=j), g.input(f"b{k}", (4, 4), gpu=j)
        p = g.matmul(a, b, id=f"p{k}")
        parts.append(p if j == 0 else g.transfer(p, 0, id=f"p{k}_to0"))
    acc = g.kernel("accumulate", *parts, id="acc")
    g.output(g.scale(acc, 2.0, id="out"))
    return g


def inputs(tg: TaskGraph, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {v.id: torch.randn(v.shape, generator=gen) for v in tg.caller_inputs()}


def test_the_core_lets_one_member_of_a_group_run_at_a_time():
    tg = grads(4)
    mg = naive_memgraph(tg)
    members = [v.id for v in mg.vertices if v.acc is not None]
    assert [mg.vertex(m).acc for m in members] == [(k, 4) for k in range(4)]
    core = WorkerCore(mg, 0)
    core.start(ahead=True)
    core.dispatch([v.id for v in mg.vertices])
    order = []
    while not core.finished:
        v = core.pop()
        assert v is not None
        core.launch(v)
        running = {v}
        if v in members:
            # no other member is ready while this one holds the lock
            assert not any(w in members for w in core.ready), core.ready
            order.append(v)
        core.complete(running.pop())
    assert sorted(order) == members


@pytest.mark.parametrize("seed", range(6))
def test_members_in_any_order_sum_to_the_reference(seed):
    tg = grads(6)
    ins = inputs(tg, seed)
    want = evaluate(tg, ins)["out"]
    got = execute_random_order(naive_memgraph(tg), tg, ins, seed)["out"]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_runtime_runs_sum_into_under_the_lock_with_random_delays(gpus):
    tg = grads(6, gpus)
    mg = naive_memgraph(tg)
    with Program(tg, mg, engine="local", streams=4) as prog:
        for seed in range(4):
            ins = inputs(tg, seed)
            out = prog.run(ins, delay=(0, 2e-3), seed=seed, check=True)["out"]
            torch.testing.assert_close(out, evaluate(tg, ins)["out"])


def test_memgraph_accumulate_round_trips_and_is_checked():
    mg = naive_memgraph(grads(3))
    back = MemGraph.from_dict(mg.to_dict())
    assert [v.acc for v in back.vertices] == [v.acc for v in mg.vertices]
    doc = mg.to_dict()
    doc["vertices"][-3]["accumulate"] = {"part": 3, "parts": 3}
    with pytest.raises(Exception, match="accumulate"):
        MemGraph.from_dict(doc)


# ---- the planner's groups, the verifier and the symbolic executor --------------------------------


def _plan(tg: TaskGraph, cap: int, mode: str = "eager") -> MemGraph:
    return build_memgraph(tg, cap, sum_into=mode)


@pytest.mark.parametrize("gpus,cap", [(1, 1 << 20), (1, 1536), (2, 1 << 20), (2, 1536)])
def test_the_planner_makes_a_verified_group_that_computes_the_sum(gpus, cap):
    from planner.symbolic import check_random_orders
    from planner.verify import verify

    tg = grads(6, gpus)
    mg = _plan(tg, cap)
    members = [v for v in mg.vertices if v.acc is not None]
    assert sorted(v.acc for v in members) == [(k, 6) for k in range(6)]
    assert {v.out for v in members} == {members[0].out}  # one range
    assert mg.outputs["out"] not in {v.id for v in members}
    assert verify(tg, mg) == []
    check_random_orders(tg, mg, 24, seed=gpus)
    for seed in range(3):
        ins = inputs(tg, seed)
        got = execute_random_order(mg, tg, ins, seed)["out"]
        torch.testing.assert_close(got, evaluate(tg, ins)["out"])


def test_each_partial_dies_at_its_member():
    """Eager members hold one partial at a time beside the sum: 8 partials of 256 bytes sum in
    1 KiB without a reload; deferred ones reload, and the n-ary kernel needs all 9 ranges at once."""
    tg = grads(8)
    eager, deferred = _plan(tg, 1024), _plan(tg, 1024, "deferred")
    assert eager.stats["sum_into"] == "eager" and eager.stats["bytes_reloaded"] == 0
    assert deferred.stats["sum_into"] == "deferred" and deferred.stats["bytes_reloaded"] > 0
    with pytest.raises(Exception, match="need 2304 bytes"):
        _plan(tg, 1024, "off")
    off = _plan(tg, 1 << 20, "off")
    assert off.stats["sum_into"] == "off" and not any(v.acc for v in off.vertices)
    # a partial is read by its member only, and partials share ranges
    member_of = {v.ins[0].src: v.id for v in eager.vertices if v.acc is not None}
    assert len({eager.vertex(s).out for s in member_of}) < len(member_of)


def test_a_sum_in_the_way_is_planned_again_deferred():
    """Between two members a vertex needs the whole arena: the open sum may not move, so the plan
    is made again with that group's members at the accumulate's place."""
    from planner.verify import verify

    g = TaskGraph(1)
    p0 = g.scale(g.input("a", (4, 4)), 2.0, id="p0")
    h = g.scale(g.input("h", (16, 16)), 2.0, id="hh")
    p1 = g.scale(g.input("b", (4, 4)), 3.0, id="p1")
    acc = g.kernel("accumulate", p0, p1, id="acc")
    g.output(g.add(acc, g.input("c", (4, 4)), id="out"), h)
    order = ["a", "p0", "h", "hh", "b", "p1", "acc", "c", "out"]
    mg = build_memgraph(g, 2048, order=order)
    assert mg.stats["sum_into"] == "eager" and mg.stats["sum_into_demoted"] == {"deferred": 1, "off": 0}
    assert build_memgraph(g, 2048, order=order, sum_into="deferred").stats["sum_into"] == "deferred"
    assert verify(g, mg) == []
    ins = inputs(g)
    got = execute_random_order(mg, g, ins)
    for k, want in evaluate(g, ins).items():
        torch.testing.assert_close(got[k], want)


@pytest.mark.parametrize("cap,demoted", [(1024, 0), (768, 1)])
def test_an_offloading_plan_keeps_the_sum_in_place_between_members(cap, demoted):
    """k0 is offloaded while the sum is open (1 KiB); in 768 bytes a matmul's three ranges and an
    open sum do not fit, so the group's members are planned at the accumulate's place."""
    from planner.verify import verify

    g = TaskGraph(1)
    k0 = g.scale(g.input("k", (4, 4)), 2.0, id="k0")
    parts = [g.matmul(g.input(f"a{i}", (4, 4)), g.input(f"b{i}", (4, 4)), id=f"p{i}") for i in range(6)]
    g.output(g.add(g.kernel("accumulate", *parts, id="acc"), k0, id="out"))
    mg = build_memgraph(g, cap, order=[v.id for v in g])
    assert mg.stats["sum_into"] == "eager" and mg.stats["bytes_offloaded"] > 0
    assert mg.stats.get("sum_into_demoted", {}).get("deferred", 0) == demoted
    assert verify(g, mg) == []
    for seed in range(3):
        ins = inputs(g, seed)
        torch.testing.assert_close(execute_random_order(mg, g, ins, seed)["out"], evaluate(g, ins)["out"])


def _errors(tg: TaskGraph, mg: MemGraph) -> tuple[list[str], str]:
    from disco_ray.graph.errors import VerifyError
    from planner.symbolic import check_random_orders
    from planner.verify import verify

    try:
        check_random_orders(tg, mg, 40, seed=0)
        sym = ""
    except VerifyError as e:
        sym = str(e)
    return verify(tg, mg), sym


def _members(mg: MemGraph) -> list[int]:
    return [i for i, v in enumerate(mg.vertices) if v.acc is not None]


def test_a_planted_missing_member_is_caught():
    tg = grads(4)
    mg = naive_memgraph(tg)
    gone = mg.vertices[_members(mg)[1]].id
    bad = replaced(
        mg,
        vertices=[v for v in mg.vertices if v.id != gone],
        edges=[e for e in mg.edges if gone not in e[:2]],
    )
    msgs, sym = _errors(tg, bad)
    assert any("parts [1] of 4 have no member" in m for m in msgs), msgs
    assert "partial sum" in sym


def test_a_planted_duplicate_part_is_caught():
    import dataclasses

    tg = grads(4)
    mg = naive_memgraph(tg)
    verts = list(mg.vertices)
    i = _members(mg)[2]
    verts[i] = dataclasses.replace(verts[i], acc=(1, 4))
    msgs, sym = _errors(tg, replaced(mg, vertices=verts))
    assert any("part 1 of 'acc' is also" in m for m in msgs), msgs
    assert any("parts [2] of 4 have no member" in m for m in msgs), msgs
    assert "was added already" in sym


def test_a_planted_reader_before_a_member_is_caught():
    tg = grads(4)
    mg = naive_memgraph(tg)
    first = mg.vertices[_members(mg)[0]].id
    reader = mg.outputs["out"]
    bad = replaced(mg, edges=[e for e in mg.edges if e[:2] != (first, reader)])
    msgs, sym = _errors(tg, bad)
    assert any(f"no path {first} -> {reader}" in m and "follows every member" in m for m in msgs), msgs
    assert "partial sum" in sym


def test_a_planted_member_writing_another_range_is_caught():
    import dataclasses

    from disco_ray.graph.memgraph import Loc

    tg = grads(4)
    mg = naive_memgraph(tg)
    verts = list(mg.vertices)
    i = _members(mg)[1]
    o = verts[i].out
    verts[i] = dataclasses.replace(verts[i], out=Loc(o.device, mg.capacity[0], o.nbytes))
    bad = replaced(mg, vertices=verts)
    bad.capacity[0] += o.nbytes
    msgs, sym = _errors(tg, bad)
    assert any("its group writes" in m for m in msgs), msgs
    assert sym


def test_a_planted_overlapping_writer_is_caught():
    """A writer of the sum's range that the edges leave free to land between two members."""
    import dataclasses

    tg = grads(4)
    z = tg.scale("a0", 3.0, id="z")
    tg.output(z)
    mg = naive_memgraph(tg)
    verts = list(mg.vertices)
    acc_range = verts[_members(mg)[0]].out
    i = next(i for i, v in enumerate(verts) if v.value == "z")
    verts[i] = dataclasses.replace(verts[i], out=acc_range)
    msgs, sym = _errors(tg, replaced(mg, vertices=verts))
    assert any(f"writes {'gpu:0'}[{acc_range.offset}:{acc_range.end}]" in m for m in msgs), msgs
    assert sym
    # ordered after every member's reader, the same writer is fine for the group
    ok = replaced(mg, vertices=verts, edges=[*mg.edges, (mg.outputs["out"], verts[i].id, "mem")])
    ok.outputs.pop("z")
    from planner.verify import verify

    assert not any("acc" in m for m in verify(tg, ok)), verify(tg, ok)


def test_renumbering_a_plan_keeps_its_groups():
    """bench modes renumber vertices: members keep `accumulate`, readers name the new last member."""
    from disco_ray.bench.modes import _renumber
    from planner.verify import verify

    tg = grads(4)
    mg = naive_memgraph(tg)
    ms = _members(mg)
    assert ms == list(range(ms[0], ms[0] + 4))
    order = list(range(len(mg)))
    order[ms[0] : ms[-1] + 1] = ms[::-1]  # members are unordered: reversed is still topological
    new = _renumber(mg, order)
    assert verify(tg, new) == []
    part0 = next(v.id for v in new.vertices if v.acc == (0, 4))
    assert part0 == max(v.id for v in new.vertices if v.acc)
    assert new.vertex(new.outputs["out"]).ins[0].src == part0


def random_sums(seed: int) -> TaskGraph:
    """A random graph of products summed by accumulates (repeated operands, sums of sums, sums
    read by later products), on 2 GPUs."""
    import random

    rng = random.Random(seed)
    g = TaskGraph(2)
    vals: list[list[str]] = [[], []]
    for k in range(4):
        for j in range(2):
            vals[j].append(g.input(f"x{k}_g{j}", (4, 4), gpu=j))
    for k in range(14):
        j = rng.randrange(2)
        if rng.random() < 0.35 and len(vals[j]) >= 2:
            ops = rng.choices(vals[j][-8:], k=rng.randint(1, 5))
            vals[j].append(g.kernel("accumulate", *ops, id=f"s{k}"))
        elif rng.random() < 0.2:
            vals[j].append(g.transfer(rng.choice(vals[1 - j]), j, id=f"t{k}"))
        else:
            a, b = rng.choice(vals[j][-6:]), rng.choice(vals[j][-6:])
            vals[j].append(g.scale(g.matmul(a, b, id=f"m{k}"), 0.5, id=f"n{k}"))
    g.output(vals[0][-1], vals[1][-1])
    return g


@pytest.mark.parametrize("seed", range(6))
def test_random_graphs_of_sums_plan_verify_and_compute(seed):
    from disco_ray.graph.errors import CapacityError
    from planner import min_capacity, roomy_capacity
    from planner.symbolic import check_random_orders
    from planner.verify import verify

    tg = random_sums(seed)
    lo, hi = max(min_capacity(tg)), max(roomy_capacity(tg))
    ins = inputs(tg, seed)
    want = evaluate(tg, ins)
    modes, spilled = set(), False
    cases = [
        (cap, order, None) for cap in sorted({lo, (lo + hi) // 2, hi, 768, 1024}) for order in ("p", "l")
    ]
    cases.append((lo, "l", 0))  # no host store: every offload goes to the spill file
    for cap, order, host in cases:
        try:
            mg = build_memgraph(
                tg, cap, order=None if order == "p" else [v.id for v in tg], host_capacity=host
            )
        except CapacityError:
            continue
        spilled = spilled or mg.stats.get("bytes_offloaded_disk", 0) > 0
        modes.add(mg.stats["sum_into"])
        assert verify(tg, mg) == [], (seed, cap)
        check_random_orders(tg, mg, 8, seed)
        got = execute_random_order(mg, tg, ins, seed)
        for k, w in want.items():
            torch.testing.assert_close(got[k], w, rtol=1e-4, atol=1e-4, msg=f"seed {seed} capacity {cap}")
    assert modes and spilled, seed


def test_the_runtime_runs_a_planned_group_under_pressure_with_random_delays():
    tg = grads(6, 2)
    mg = _plan(tg, 1536)
    assert mg.stats["sum_into"] == "eager"
    with Program(tg, mg, engine="local", streams=4) as prog:
        for seed in range(3):
            ins = inputs(tg, seed)
            out = prog.run(ins, delay=(0, 2e-3), seed=seed, check=True)["out"]
            torch.testing.assert_close(out, evaluate(tg, ins)["out"])
