"""The TURNIP paper's three-GPU example (section 4, Figures 2-7) through the planner.

The paper's figures are not reproduced in its text, so the TaskGraph is reconstructed from what
the text says about it: X x Y on three GPUs (Figure 2: X in 2 x 2 blocks, Y in 2 x 1 blocks, so
X x Y = [X1 Y1 + X2 Y2; X3 Y1 + X4 Y2]); six kernels and three transfers (Figure 3); equal-size
tensors; GPU 1 handles seven tensors, two inputs (A = X1, B = X2) and five it creates (1, 2: Y1, Y2
transferred in; 3 = A x 1, 4 = B x 2, 8 = 3 + 4); A and 1 are read only by 3, 2 only by 4, and 8
reads 3. GPU 1 of the paper is gpu 0 here. With five one-tensor slots per GPU the outputs of 4
and 8 reuse the slots of A and 1 after 3 has read them (Figure 4), with a memory edge 3 -> 4
(Figure 5); with four slots, running 4 before 3 forces an eviction and a reload (Figures 6-7).
"""

from __future__ import annotations

import pytest

from disco_ray.graph.memgraph import INPUT, MemGraph, MKind
from disco_ray.graph.taskgraph import TaskGraph
from planner import build_memgraph
from planner.symbolic import check_random_orders
from planner.verify import verify

N = 16
SLOT = N * N * 4  # one float32 [16, 16] tensor, a multiple of the 256-byte alignment


def paper_taskgraph() -> TaskGraph:
    g = TaskGraph(gpus=3)
    g.input("A", (N, N), gpu=0)  # X1
    g.input("B", (N, N), gpu=0)  # X2
    g.input("X3", (N, N), gpu=1)
    g.input("Y1", (N, N), gpu=1)
    g.input("X4", (N, N), gpu=2)
    g.input("Y2", (N, N), gpu=2)
    g.transfer("Y1", gpu=0, id="1")
    g.transfer("Y2", gpu=0, id="2")
    g.matmul("A", "1", id="3")
    g.matmul("B", "2", id="4")
    g.add("3", "4", id="8")  # Z top = X1 Y1 + X2 Y2
    g.matmul("X3", "Y1", id="5")
    g.matmul("X4", "Y2", id="6")
    g.transfer("6", gpu=1, id="7")
    g.add("5", "7", id="9")  # Z bottom = X3 Y1 + X4 Y2
    g.output("8", "9")
    return g


# the paper's serial orders for GPU 1 (the other GPUs' vertices placed first)
OTHERS = ["X3", "Y1", "X4", "Y2", "5", "6", "7", "9"]
ORDER_FIVE = [*OTHERS, "A", "B", "1", "2", "3", "4", "8"]
ORDER_FOUR = [*OTHERS, "A", "B", "1", "2", "4", "3", "8"]


def by_value(mg: MemGraph, kinds=(MKind.INPUT, MKind.KERNEL, MKind.TRANSFER)) -> dict:
    return {v.value: v for v in mg.vertices if v.kind in kinds}


def ancestors(mg: MemGraph, vid: int) -> set[int]:
    preds: dict[int, set[int]] = {}
    for u, w, _ in mg.edges:
        preds.setdefault(w, set()).add(u)
    seen: set[int] = set()
    stack = [vid]
    while stack:
        for u in preds.get(stack.pop(), ()):
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def test_taskgraph_shape():
    tg = paper_taskgraph()
    kinds = tg.statistics()["by_kind"]
    assert kinds == {"input": 6, "kernel": 6, "transfer": 3}
    assert sum(1 for v in tg if v.gpu == 0) == 7  # GPU 1 handles seven tensors, two of them inputs


@pytest.mark.parametrize("order", [None, ORDER_FIVE, ORDER_FOUR])
def test_five_slots_need_no_offload(order):
    tg = paper_taskgraph()
    mg = build_memgraph(tg, 5 * SLOT, order=order)
    assert verify(tg, mg) == []
    check_random_orders(tg, mg, 100, seed=5)
    assert not [v for v in mg.vertices if v.kind in (MKind.OFFLOAD, MKind.RELOAD)]
    assert len(mg) == len(tg)


def test_five_slots_memory_edges_as_in_figure_5():
    tg = paper_taskgraph()
    mg = build_memgraph(tg, 5 * SLOT, order=ORDER_FIVE)
    v = by_value(mg)
    gpu0 = [x for x in v.values() if x.gpu == 0]
    # seven tensors in five slots: two outputs reuse a slot, and those are 4 and 8, written over A and 1
    slots = {x.out.offset for x in gpu0}
    assert len(slots) == 5 and all(x.out.end <= 5 * SLOT for x in gpu0)
    assert {v["4"].out, v["8"].out} <= {v["A"].out, v["1"].out, v["B"].out, v["2"].out}
    assert v["4"].out in (v["A"].out, v["1"].out)  # only A's and 1's slots are free when 3 has run
    # the memory dependency from the consumer of the overwritten value (3) to the overwriting vertex (4)
    edges = {(a, b): kind for a, b, kind in mg.edges}
    assert edges.get((v["3"].id, v["4"].id)) == "mem"
    assert (v["3"].id, v["8"].id) in edges  # 8 reads 3: a data edge, which also orders 8 after 3 reads 1
    # every vertex overwriting a slot runs after all readers of what it overwrites
    for w in gpu0:
        for u in gpu0:
            if u is not w and u.out.overlaps(w.out) and u.id in ancestors(mg, w.id):
                readers = [r for r in mg.vertices if any(rd.src == u.id for rd in r.ins)]
                assert all(r.id in ancestors(mg, w.id) for r in readers), (u.value, w.value)


def test_four_slots_offload_reload_on_gpu_1_only():
    tg = paper_taskgraph()
    mg = build_memgraph(tg, 4 * SLOT, order=ORDER_FOUR)
    assert verify(tg, mg) == []
    check_random_orders(tg, mg, 100, seed=4)
    assert verify(tg, MemGraph.from_dict(mg.to_dict())) == []  # the file form verifies the same
    moves = [x for x in mg.vertices if x.kind in (MKind.OFFLOAD, MKind.RELOAD)]
    assert moves and all(x.gpu == 0 for x in moves)
    reloads = [x for x in moves if x.kind is MKind.RELOAD]
    offloaded = {x.value for x in moves if x.kind is MKind.OFFLOAD}
    assert reloads
    for r in reloads:
        # a reload brings back an offloaded value, or a graph input from its own host copy (a clean
        # value needs no offload: the paper's offload of A is then free)
        assert r.value in offloaded or (r.ins[0].src is None and r.ins[0].loc.device == INPUT)
    # the evicted value comes back before the kernel that reads it, into a slot freed by an earlier reader
    v = by_value(mg)
    back = {r.value: r for r in reloads}
    for name, rd in zip(tg["3"].inputs, v["3"].ins):
        if name in back:
            assert rd.src == back[name].id
    assert all(x.out.end <= 4 * SLOT for x in mg.vertices if x.out.device >= 0)


def test_three_slots_still_plannable():
    # a matmul needs its two operands and its output at once: three slots are the minimum
    tg = paper_taskgraph()
    mg = build_memgraph(tg, 3 * SLOT)
    assert verify(tg, mg) == []
    check_random_orders(tg, mg, 50, seed=3)
