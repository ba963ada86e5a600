"""Chains of kernels run as one unit on one compute stream (`actors.worker_core.chains`,
`WorkerCore.claim`, the executor's units): which kernels link, that a unit never holds a kernel
whose other predecessors are not done, and runs with units equal the reference."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from actors.worker_core import WorkerCore
from disco_ray.driver.program import Program
from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MKind
from disco_ray.graph.reference import evaluate, random_inputs
from tests.runtime_helpers import MODES, noop_op, plan, random_taskgraph  # noqa: F401
from tests.test_runtime_local import assert_same, noop_graph


def _kinds(mg, gpu):
    return {v.id: v.kind for v in mg.vertices if v.gpu == gpu}


@pytest.mark.parametrize("seed", range(6))
def test_chains_link_only_what_one_stream_may_run_back_to_back(seed):
    _check_chains(seed)


def _after(core: WorkerCore) -> dict[int, tuple[int, ...]]:
    """Each chain member -> the members after it in its chain."""
    return {v: chain[core._pos[v] + 1 :] for v, chain in core.chain_of.items()}


def _check_chains(seed: int) -> int:
    """Checks the chains of a random plan on one and on several compute streams; returns how many
    chains on several streams begin with a fan-out."""
    tg = random_taskgraph(40 + seed, n=40, gpus=2)
    mg = plan(tg, MODES[seed % 2])
    gpu_of = {v.id: v.gpu for v in mg.vertices}
    ends = several = 0
    for gpu in range(2):
        core = WorkerCore(mg, gpu)
        after = _after(core)
        kinds = _kinds(mg, gpu)
        kernels = sorted(v for v, k in kinds.items() if k is MKind.KERNEL)
        remote_preds = {w for u, w, *_ in mg.edges if gpu_of[w] == gpu and gpu_of[u] != gpu}
        heads = [v for v in after if core._pos[v] == 0]
        assert heads or not after
        for h in heads:
            chain = (h, *after[h])
            assert len(chain) > 1
            i = kernels.index(h)
            assert list(chain) == kernels[i : i + len(chain)]  # consecutive kernel ids
            for v, w in itertools.pairwise(chain):
                assert v in core.kernels and w in core.kernels  # no sum-into member
                assert v not in core.awaited  # its completion goes to another GPU at once
                assert all(kinds[u] is MKind.KERNEL for u in core.local_succs.get(v, ()))
                assert w not in remote_preds
                assert after[v] == chain[chain.index(v) + 1 :]
        ends += len(heads)
        # several compute streams: a region, whose inner members feed only later members
        core = WorkerCore(mg, gpu, streams=3)
        after = _after(core)
        for v, rest in after.items():
            chain = core.chain_of[v]
            assert list(chain) == sorted(chain) and v in core.kernels  # ids in order: a topological order
            if rest:  # v is inner: nothing outside the chain waits on it
                assert set(core.local_succs.get(v, ())) <= set(rest), f"{v} feeds a vertex outside {rest}"
                assert v not in core.awaited
            if core._pos[v]:  # a later member has a predecessor earlier in the chain
                assert set(core.local_preds[v]) & set(chain[: core._pos[v]]) and v not in remote_preds
        several += sum(1 for v in after if core._pos[v] == 0 and len(core.local_succs.get(v, ())) > 1)
    assert ends > 2  # transfers, and in a tight plan offloads, end chains
    return several


def test_regions_on_several_streams_hold_fan_outs():
    """On several streams a chain may hold a fan-out (a head feeding two members, both inside):
    the random graphs have some."""
    assert sum(_check_chains(seed) for seed in range(6)) > 0


def _run_with_units(mg, rng) -> int:
    """The core driven as the executor drives it on one compute stream (copies complete in a
    random order meanwhile); checks each unit when claimed; returns the kernels run in units."""
    core = WorkerCore(mg, 0)
    core.start(ahead=False)
    core.dispatch(core.mine)
    kinds = _kinds(mg, 0)
    done: set[int] = set()
    copies: list[int] = []
    kernels: list[int] = []
    stream: tuple[int, ...] | None = None
    in_units = 0
    while not core.finished:
        while (v := core.pop()) is not None:
            if kinds[v] is MKind.KERNEL:
                heapq.heappush(kernels, v)
            else:
                copies.append(v)
        if stream is None and kernels:
            head = heapq.heappop(kernels)
            stream = core.claim(head) if head in core.chain_of and head not in core.groups else (head,)
            for i, m in enumerate(stream):
                for u in core.local_preds.get(m, ()):
                    assert u in done or u in stream[:i], f"unit {stream}: {m} runs before its predecessor {u}"
            in_units += len(stream) if len(stream) > 1 else 0
        pick = rng.randrange(len(copies) + (stream is not None))
        if pick == len(copies):
            for m in stream:
                assert m not in done
                core.complete(m)
                done.add(m)
            stream = None
        else:
            v = copies.pop(pick)
            core.complete(v)
            done.add(v)
    assert done == set(core.mine)
    return in_units


def test_a_unit_holds_no_kernel_whose_other_predecessors_are_not_done():
    """Tight plans: loads and reloads feed kernels in the middle of chains, and complete in
    random orders; a unit stops before a kernel that waits on one (planted: without the check of
    `left` in `claim`, a kernel runs before its load)."""
    rng = random.Random(0)
    total = 0
    for seed in range(12):
        tg = random_taskgraph(500 + seed, n=40, gpus=1)
        for mode in MODES:
            mg = plan(tg, mode)
            for _ in range(4):
                total += _run_with_units(mg, rng)
    assert total > 100  # units did run


@pytest.mark.parametrize("mode,streams", [("roomy", 1), ("tight", 1), ("tight", 3)])
def test_runs_with_units_equal_the_reference(mode, streams):
    for seed in range(3):
        tg = random_taskgraph(700 + seed, n=40, gpus=2)
        inputs = random_inputs(tg, seed)
        with Program(tg, plan(tg, mode), engine="local", streams=streams) as prog:
            for _ in range(2):
                assert_same(prog.run(inputs, timeout=60), evaluate(tg, inputs), seed)
                stats = prog.statistics()["engine"]["workers"]
                assert sum(w["chained"]["vertices"] for w in stats) > 0
            recs = [r for recs in prog.last_records for r in recs]
            assert sorted(r[0] for r in recs) == sorted(v.id for v in prog.mg.vertices)  # each once
            for gpu_recs in prog.last_records:  # one stream's records never overlap
                on0 = sorted((a, b) for _, s, a, b in gpu_recs if s == 0)
                assert all(b0 <= a1 for (_, b0), (a1, _) in itertools.pairwise(on0))


def test_a_kernel_that_raises_inside_a_unit_is_named(noop_op):  # noqa: F811
    tg = noop_graph(fail_at="n5", gpus=1, n=8)
    mg = plan(tg)
    vid = next(v.id for v in mg.vertices if v.value == "n5")
    with Program(tg, mg, engine="local", streams=1) as prog:
        with pytest.raises(RunError, match=rf"gpu:0 vertex {vid} \(kernel 'n5'\) raised RuntimeError"):
            prog.run({}, timeout=60)
        assert prog.statistics()["engine"]["workers"][0]["chained"]["units"] == 1


@pytest.mark.parametrize("streams,ahead", [(1, 0), (1, 4), (3, 0), (3, 4)])
def test_units_on_the_cuda_stand_in_equal_the_reference(monkeypatch, streams, ahead):
    """The cuda backend on the strict stand-in (work runs later on its stream's thread, a range
    being written holds poison until then, each event takes device time): a unit's kernels are
    enqueued back to back in one launch, with or without launch ahead, on one stream (runs of
    consecutive ids) or several (regions; a kernel launched ahead behind a unit's vertex
    on another stream waits on the unit: planted without, the poison reaches the outputs), and
    the outputs equal the reference; the device times a unit as a whole (its first vertex's
    record; the others end where it ends)."""
    from actors.backends.cuda import CudaBackend
    from actors.executor import Executor
    from actors.options import WorkerConfig
    from tests.fake_cuda import FakeStream, install
    from tests.test_cuda_backend import _run, _same

    install(monkeypatch.setattr)
    monkeypatch.setattr(FakeStream, "device_s", 2e-4)
    for seed in range(2):
        tg = random_taskgraph(900 + seed, n=50, gpus=1, size=16)
        mg = plan(tg, MODES[seed])
        config = WorkerConfig(streams=streams, ahead=ahead)
        ex = Executor(0, mg, tg, config, backend=CudaBackend())
        try:
            before = 0
            for run in range(2):
                inputs = random_inputs(tg, run)
                assert _run(ex, inputs, coordinated=False) is None, ex.error
                out = {k: ex.output(k, mg.outputs[k]) for k in tg.outputs}
                _same(out, evaluate(tg, inputs), f"seed {seed} run {run} ahead {ahead}")
                units, held = ex.slots.chained
                assert units > 0 and held > units
                assert sorted(r[0] for r in ex.trace) == sorted(ex.core.mine)
                launches = ex.statistics()["backend"]["host"]["launches"]  # since the first run
                skipped = len(ex._inline)  # loads the arena held: completed at launch, not launched
                assert launches - before == len(ex.core.mine) - held + units - skipped  # one per unit
                before = launches
        finally:
            ex.close()


@pytest.mark.parametrize("streams", [1, 3])
def test_loads_the_arena_holds_are_not_launched_ahead(monkeypatch, streams):
    """With launch ahead on the strict stand-in, a run whose inputs the arena still holds (none
    passed again) completes those loads where they are taken, not on their lane: no launch, no
    event, and the kernels launched ahead behind them in the same pass wait on nothing of theirs
    (the stand-in refuses a wait on an event never recorded). Measured on the stand-in's decode
    step (1 stream): 182 launches per step before, 84 after. Planted: loads launched as before
    (the count is off), waits kept (the stand-in's assertion fails the run)."""
    from actors.backends.cuda import CudaBackend
    from actors.executor import Executor
    from actors.options import WorkerConfig
    from tests.fake_cuda import FakeStream, install
    from tests.test_cuda_backend import _run, _same

    install(monkeypatch.setattr)
    monkeypatch.setattr(FakeStream, "device_s", 2e-4)
    tg = random_taskgraph(911, n=50, gpus=1, size=16)
    mg = plan(tg, "roomy")
    ex = Executor(0, mg, tg, WorkerConfig(streams=streams, ahead=4), backend=CudaBackend())
    try:
        inputs = random_inputs(tg, 0)
        want = evaluate(tg, inputs)
        assert _run(ex, inputs, coordinated=False) is None, ex.error
        before = ex.statistics()["backend"]["host"]["launches"]
        assert _run(ex, {}, coordinated=False) is None, ex.error  # the arena holds every input
        assert ex._skip and ex._inline == ex._skip
        _same({k: ex.output(k, mg.outputs[k]) for k in tg.outputs}, want, f"streams {streams}")
        units, held = ex.slots.chained
        launches = ex.statistics()["backend"]["host"]["launches"] - before
        assert launches == len(ex.core.mine) - held + units - len(ex._skip)
    finally:
        ex.close()
