"""The simulator runs the runtime's own cores: hand-made graphs with exactly known schedules, a
change of the runtime's policy showing in the prediction, and a local-engine trace replayed."""

from __future__ import annotations

import itertools

import pytest

import workloads
from actors import lanes
from disco_ray.bench.replay import Replay, durations, host_lags, makespan, replay
from disco_ray.bench.sim_engine import Host
from disco_ray.bench.simulate import simulate
from disco_ray.graph.memgraph import MKind
from disco_ray.graph.taskgraph import TaskGraph
from tests.memgraph_helpers import naive_memgraph


def _spans(r) -> dict[int, tuple[float, float]]:
    return {v: (s, e) for v, _, _, s, e in r.timeline}


def _depth_graph():
    """One GPU: loads a, b, c ready at once; r (id 2) may load only once kernel k has read a."""
    g = TaskGraph(1)
    a = g.input("a", (2, 2))
    k = g.kernel("softmax", a, id="k")
    r = g.input("r", (2, 2))
    b = g.input("b", (2, 2))
    c = g.input("c", (2, 2))
    g.output(k, b, c, g.add(r, r, id="k2"))
    mg = naive_memgraph(g, [("k", "r")])
    seconds = {0: 1.0, 1: 0.25, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}  # a k r b c k2
    return g, mg, Replay(seconds, overlap=False)


def test_copy_depth_is_the_runtimes(monkeypatch):
    # depth 2: b and c are on the lane before r is ready, so r loads last and k2 waits for it
    g, mg, cost = _depth_graph()
    r = simulate(mg, g, cost)
    assert _spans(r)[2] == (3.0, 4.0) and _spans(r)[4] == (2.0, 3.0) and r.makespan == 5.0
    assert {r.stream_of[v] for v in (0, 2, 3, 4)} == {5}  # the h2d lane, after 5 compute streams
    # the runtime's lane rule changed in actors/lanes.py changes the prediction: with one copy
    # in flight, r (the lowest id ready) goes before c
    monkeypatch.setattr(lanes, "COPY_DEPTH", 1)
    r1 = simulate(mg, g, cost)
    assert _spans(r1)[2] == (2.0, 3.0) and _spans(r1)[4] == (3.0, 4.0) and r1.makespan == 4.0


def test_launch_ahead_changes_the_order_on_the_gpu():
    # k1 runs; kx becomes ready at 0.5. Launched ahead, k2 is on the device behind k1 before kx
    # is, so it runs first; launched when ready, it comes after kx
    g = TaskGraph(1)
    x = g.input("x", (2, 2))
    k1 = g.kernel("softmax", x, id="k1")
    k2 = g.kernel("softmax", k1, id="k2")
    ld = g.input("l", (2, 2))
    g.output(k2, g.kernel("softmax", ld, id="kx"))
    mg = naive_memgraph(g)
    cost = Replay({0: 0.0, 1: 1.0, 2: 1.0, 3: 0.5, 4: 1.0}, overlap=False)
    now = simulate(mg, g, cost, ahead=0)
    assert (_spans(now)[4], _spans(now)[2]) == ((1.0, 2.0), (2.0, 3.0))
    early = simulate(mg, g, cost, ahead=1)
    assert (_spans(early)[2], _spans(early)[4]) == ((1.0, 2.0), (2.0, 3.0))
    # k1 and kx went to the device behind their loads, k2 behind k1 on its stream
    assert early.stream_of[2] == early.stream_of[1] == 0 and early.stats["launched_ahead"] == 3
    assert now.stats["launched_ahead"] == 0


def test_compute_streams_bound_overlapping_kernels():
    # measured durations (overlap): kernels of different streams run side by side, S at a time
    g = TaskGraph(1)
    x = g.input("x", (2, 2))
    g.output(*[g.kernel("softmax", x, id=f"k{i}") for i in range(3)])
    mg = naive_memgraph(g)
    cost = Replay({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    assert simulate(mg, g, cost, streams=2).makespan == 3.0
    assert simulate(mg, g, cost, streams=3).makespan == 2.0
    assert simulate(mg, g, cost, streams=1).makespan == 4.0
    assert simulate(mg, g, Replay(cost.seconds, overlap=False), streams=3).makespan == 4.0


def test_the_reporter_holds_back_a_completion_while_its_worker_is_busy():
    # x0 is reported at once (the reporter's first pass); x1 ends while it sleeps, and gpu 0 is
    # still busy with x2, so the transfer of x1 waits for the next pass, flush_s later
    g = TaskGraph(2)
    xs = [g.input(f"x{i}", (2, 2), gpu=0) for i in range(3)]
    g.output(g.transfer(xs[0], 1, id="t0"), g.transfer(xs[1], 1, id="t1"), xs[2])
    mg = naive_memgraph(g)
    cost = Replay({0: 0.5, 1: 0.25, 2: 0.875, 3: 0.25, 4: 0.25}, overlap=False)
    ideal = simulate(mg, g, cost)
    assert _spans(ideal)[4] == (0.75, 1.0) and ideal.makespan == 1.625
    lag = simulate(mg, g, cost, host=Host(flush_s=1.0))
    assert _spans(lag)[3] == (0.5, 0.75) and _spans(lag)[4] == (1.5, 1.75) and lag.makespan == 1.75
    assert _spans(simulate(mg, g, cost, host=Host(flush_s=0.5)))[4] == (1.0, 1.25)
    # a report call of 0.125: x0's batch reaches the coordinator at 0.625, and the next pass
    # (which sends x1's) comes flush_s after the call returned, at 1.625
    sent = simulate(mg, g, cost, host=Host(flush_s=1.0, report_s=0.125))
    assert _spans(sent)[3] == (0.625, 0.875) and _spans(sent)[4] == (1.75, 2.0) and sent.makespan == 2.0


def test_host_costs_of_completions_and_wake_ups():
    # the coordinator's dispatch wakes the h2d lane's thread for x; x's completion wakes a compute
    # stream's thread for k; k2 follows k on its stream (the same thread: no wake-up)
    g = TaskGraph(1)
    x = g.input("x", (2, 2))
    k = g.kernel("softmax", x, id="k")
    g.output(g.kernel("softmax", k, id="k2"))
    mg = naive_memgraph(g)
    r = simulate(mg, g, Replay({0: 1.0, 1: 1.0, 2: 1.0}), host=Host(done_s=0.125, wake_s=0.25))
    assert _spans(r) == {0: (0.25, 1.25), 1: (1.625, 2.625), 2: (2.75, 3.75)}
    assert r.stream_of[1] == r.stream_of[2] == 0


def _check_runtime_rules(mg, at: dict[int, tuple[int, float, float]], limits) -> None:
    """What the runtime guarantees, on a schedule (vid -> (stream, start, end)): edges hold, a
    stream runs one vertex at a time, a copy runs on its lane (the lane rule)."""
    for u, w, _ in mg.edges:
        assert at[u][2] <= at[w][1], (u, w)
    by_stream: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for v in mg.vertices:
        by_stream.setdefault((v.gpu, at[v.id][0]), []).append(at[v.id][1:])
        lane = limits[v.gpu].lane(v)
        assert at[v.id][0] == lane if lane is not None else at[v.id][0] < limits[v.gpu].streams, v
    for spans in by_stream.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.parametrize(("name", "kw", "frac"), [("matmul_chain", {}, None), ("llama_prefill", {}, 0.1)])
def test_a_local_engine_trace_replayed_follows_the_runtimes_rules(name, kw, frac):
    from disco_ray.driver.program import Program
    from planner import build_memgraph, roomy_capacity

    w = workloads.build(name, **kw)
    tg = w.taskgraph
    need = max(tg.statistics()["tensor_bytes_per_gpu"])
    mg = build_memgraph(tg, roomy_capacity(tg) if frac is None else int(need * frac))
    with Program(tg, mg, engine="local", backend="cpu") as prog:
        runs = [prog.run(w.inputs, details=True).records for _ in range(2)]
    cost, host = replay(mg, runs)
    assert set(cost.seconds) == {v.id for v in mg.vertices} and host.flush_s == 1e-3
    r = simulate(mg, tg, cost, host=host)
    sim = {v: (r.stream_of[v], s, e) for v, _, _, s, e in r.timeline}
    measured = {vid: (s, t0 / 1e9, t1 / 1e9) for recs in runs[-1] for vid, s, t0, t1 in recs}
    rule = {g: lanes.Lanes.of(mg, g, 5) for g in range(mg.gpus)}
    _check_runtime_rules(mg, measured, rule)  # the runtime obeyed them ...
    _check_runtime_rules(mg, sim, rule)  # ... and so does the simulator, on the same streams
    copies = [v.id for v in mg.vertices if v.kind is not MKind.KERNEL]
    assert [sim[v][0] for v in copies] == [measured[v][0] for v in copies]
    # the inputs (in a plan that fits, all ready at the start) go through each h2d lane in id order
    for g in range(mg.gpus if frac is None else 0):
        h2d = rule[g].h2d
        order = [
            sorted((at[v][1], v) for v in at if at[v][0] == h2d and mg.vertex(v).gpu == g)
            for at in (sim, measured)
        ]
        ins = [[v for _, v in o if mg.vertex(v).kind is MKind.INPUT] for o in order]
        assert ins[0] == ins[1] == sorted(ins[0])
    assert makespan(runs[-1]) > 0 and r.makespan > 0


def test_replay_statistics_from_records():
    g = TaskGraph(1)
    x = g.input("x", (2, 2))
    k = g.kernel("softmax", x, id="k")
    g.output(g.kernel("softmax", k, id="k2"), g.kernel("softmax", x, id="k3"))
    mg = naive_memgraph(g)
    # (vid, stream, t0 ns, t1 ns): k2 after k on its stream (a 10 ns gap), k3 on another (40 ns)
    runs = [[[(0, 5, 0, 100), (1, 0, 150, 200), (2, 0, 210, 300), (3, 1, 150, 160)]]]
    runs.append([[(0, 5, 0, 300), (1, 0, 350, 400), (2, 0, 410, 500), (3, 1, 350, 360)]])
    assert durations(runs) == pytest.approx({0: 200e-9, 1: 50e-9, 2: 90e-9, 3: 10e-9})
    done, wake = host_lags(mg, runs)
    assert done == pytest.approx(10e-9) and wake == pytest.approx(40e-9)
    assert makespan(runs[0]) == 300e-9
    with pytest.raises(Exception, match="no record of vertex 3"):
        simulate(mg, g, Replay({0: 1.0, 1: 1.0, 2: 1.0}))
