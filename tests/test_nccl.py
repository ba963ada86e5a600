"""NCCL transfers on the stand-ins (tests/fake_cuda.py, tests/fake_nccl.py): no GPU, no NCCL.

The stand-in NCCL blocks as NCCL does (see its docstring), so these tests show on a CPU what
would hang on GPUs: the transports move both directions of a pair at once, many pairs, and a
lost peer ends the run with an error naming it, in bounded time. What they cannot show: NCCL's
own speed, its buffer sizes, and real GPUs' memory (see benchmarks/gpu_session.sh).
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from actors import resources
from actors.backends.cuda import CudaBackend
from actors.options import RunOptions, WorkerConfig
from actors.transports import cuda as transport_cuda
from actors.transports import nccl as nccl_channel
from actors.transports.cuda import CudaTransport, choose_paths, nccl_members
from actors.transports.nccl import NcclOp, nccl_ops, next_group
from disco_ray.driver.engine_local import LocalEngine
from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc, MKind
from disco_ray.graph.reference import evaluate, random_inputs
from tests import fake_nccl
from tests.fake_cuda import FakeEvent, FakeStream, install
from tests.runtime_helpers import plan, random_taskgraph

WAIT_S = 30.0  # bounds every wait below: a hang fails the test instead of hanging it


# ---- the stand-in itself ---------------------------------------------------------------------------
def _on(thread_fn, *args) -> threading.Thread:
    t = threading.Thread(target=thread_fn, args=args, daemon=True)
    t.start()
    return t


def _until(cond, what: str) -> None:
    t_end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < t_end, what
        time.sleep(1e-3)


def test_the_stand_in_blocks_as_nccl_does(monkeypatch):
    """Creation waits for every rank; a first send waits on the host until the peer posts; a
    communicator refuses a second thread; one direction before the other deadlocks on the
    device unless grouped, and the k-th send meets the k-th receive."""
    install(monkeypatch.setattr)
    uid = fake_nccl.get_unique_id()
    comms: dict[int, fake_nccl.NcclCommunicator] = {}
    calls: dict[int, list] = {0: [], 1: []}  # work each rank's owner thread runs, in order
    go = {0: threading.Semaphore(0), 1: threading.Semaphore(0)}
    finished = {0: threading.Semaphore(0), 1: threading.Semaphore(0)}

    def owner(r):  # makes the communicator, then runs what it is given: NCCL wants one thread
        comms[r] = fake_nccl.NcclCommunicator(2, uid, r)
        while go[r].acquire(timeout=WAIT_S):
            fn = calls[r].pop(0)
            if fn is None:
                return
            fn()
            finished[r].release()

    def run(r, fn):
        calls[r].append(fn)
        go[r].release()

    t0 = _on(owner, 0)
    _until(lambda: 0 in fake_nccl.world_of(uid).comms, "rank 0 never joined")
    assert t0.is_alive() and 0 not in comms, "creation returned before rank 1 joined"
    t1 = _on(owner, 1)
    _until(lambda: len(comms) == 2, "creation never returned")
    world = fake_nccl.world_of(uid)

    a, b = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    sa, sb = FakeStream(), FakeStream()
    u8 = fake_nccl.NCCL_UINT8
    run(0, lambda: comms[0].send(a.data_ptr(), 64, u8, 1, sa.cuda_stream))
    _until(lambda: (0, 1) in world.wants, "rank 0 never posted")
    assert not finished[0].acquire(timeout=0), "the first send returned before the peer posted"
    run(1, lambda: comms[1].recv(b.data_ptr(), 64, u8, 0, sb.cuda_stream))
    assert finished[0].acquire(timeout=WAIT_S) and finished[1].acquire(timeout=WAIT_S)
    ev = FakeEvent()
    ev.record(sb)
    assert ev.query() and torch.equal(a, b)

    with pytest.raises(AssertionError, match="used from thread"):
        comms[0].send(a.data_ptr(), 64, u8, 1, sa.cuda_stream)

    # grouped, both directions of a pair move at once
    x0, y0 = torch.full((32,), 1, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    x1, y1 = torch.full((32,), 2, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    sa2, sb2 = FakeStream(), FakeStream()
    grouped = []
    for r, s, x, y in ((0, sa2, x0, y0), (1, sb2, x1, y1)):

        def both(r=r, s=s, x=x, y=y):
            fake_nccl.groupStart()
            comms[r].send(x.data_ptr(), 32, u8, 1 - r, s.cuda_stream)
            comms[r].recv(y.data_ptr(), 32, u8, 1 - r, s.cuda_stream)
            fake_nccl.groupEnd()

        run(r, both)
        grouped.append(s)
    assert finished[0].acquire(timeout=WAIT_S) and finished[1].acquire(timeout=WAIT_S)
    for s in grouped:
        e = FakeEvent()
        e.record(s)
        assert e.query()
    assert y0.eq(2).all() and y1.eq(1).all()
    # both ranks send first, then receive, each in its own call: each receive sits behind its
    # rank's send, which waits for that very receive: nothing completes (NCCL past its buffers)
    run(0, lambda: (comms[0].send(x0.data_ptr(), 32, u8, 1, sa.cuda_stream),
                    comms[0].recv(y0.data_ptr(), 32, u8, 1, sa.cuda_stream)))  # fmt: skip
    run(1, lambda: (comms[1].send(x1.data_ptr(), 32, u8, 0, sb.cuda_stream),
                    comms[1].recv(y1.data_ptr(), 32, u8, 0, sb.cuda_stream)))  # fmt: skip
    assert finished[0].acquire(timeout=WAIT_S) and finished[1].acquire(timeout=WAIT_S)
    e0, e1 = FakeEvent(), FakeEvent()
    e0.record(sa)
    e1.record(sb)
    assert not e0.query() and not e1.query(), "opposite sends before the receives did not deadlock"

    for r in (0, 1):
        comms[r].abort()
        run(r, None)
    t0.join(WAIT_S)
    t1.join(WAIT_S)


# ---- the pure parts of the channel ---------------------------------------------------------------
def _op(vid, send):
    return NcclOp(vid, send, 1, -1, Loc(0, 0, 8), 8)


def test_a_group_holds_ready_operations_up_to_the_first_receive():
    ops = [_op(1, True), _op(2, True), _op(3, False), _op(4, True), _op(5, False)]
    assert next_group(ops, 0, {0, 1, 2, 3, 4}) == 3  # sends, then the receive that closes it
    assert next_group(ops, 3, {3, 4}) == 2
    assert next_group(ops, 0, {1, 2}) == 0  # the next operation is not ready: nothing goes
    assert next_group(ops, 0, {0, 1}) == 2


def test_both_ends_agree_on_the_order_of_their_transfers():
    tg = random_taskgraph(5, n=80, gpus=3, size=8)
    mg = plan(tg, "tight")
    for a in range(3):
        for b in range(a + 1, 3):
            mine = [(op.vid, op.peer == b) for op in nccl_ops(mg, a, [b])]
            theirs = [(op.vid, op.peer == a) for op in nccl_ops(mg, b, [a])]
            assert [v for v, _ in mine] == [v for v, _ in theirs], (a, b)
            for op_a, op_b in zip(nccl_ops(mg, a, [b]), nccl_ops(mg, b, [a]), strict=True):
                assert op_a.send != op_b.send and op_a.nbytes == op_b.nbytes
    assert any(v.kind is MKind.TRANSFER for v in mg.vertices)


def test_one_rank_per_gpu_in_a_communicator():
    def info(node, uuid):
        return {"node": node, "uuid": uuid, "ipc": None, "nccl": True}

    # workers 0 and 1 share GPU A on node n0; worker 2 is on node n1: NCCL takes one of the two
    infos = [info("n0", "A"), info("n0", "A"), info("n1", "B")]
    paths = choose_paths(infos, allow=("nccl", "ray"))
    assert paths == {(0, 1): "ray", (0, 2): "nccl", (1, 2): "ray"}
    assert nccl_members(paths) == [0, 2]


# ---- transfers through the channels, on the local engine ----------------------------------------
def nccl_engine(monkeypatch, tg, mg, streams=2, ahead=None):
    """The local engine with a CudaTransport per GPU whose every pair goes over the stand-in NCCL,
    connected as the driver does (every worker's connect at once); `ahead` None: the backend's
    default launch ahead."""
    install(monkeypatch.setattr, gpus=mg.gpus)
    monkeypatch.setattr(resources, "make_backend", lambda name, device=None: CudaBackend(device))
    monkeypatch.setattr(transport_cuda, "nccl_module", lambda: fake_nccl)
    n = mg.gpus
    eng = LocalEngine(
        tg,
        mg,
        config=WorkerConfig(backend="cuda", streams=streams, ahead=ahead),
        transports=lambda execs: [CudaTransport(g, []) for g in range(n)],
    )
    infos = [{"node": "n0", "uuid": f"GPU-{g}", "ipc": None, "nccl": True, "pid": -1} for g in range(n)]
    paths = choose_paths(infos, allow=("nccl",))
    uid = fake_nccl.get_unique_id()
    fake_nccl.connect_all(eng, infos, paths, uid, WAIT_S)
    eng.transports = {f"{i}-{j}": p for (i, j), p in paths.items()}
    return eng, fake_nccl.world_of(uid)


def _transfers(mg, g):
    return sum(1 for op in nccl_ops(mg, g, [p for p in range(mg.gpus) if p != g]))


@pytest.mark.parametrize(
    "seed,gpus,mode", [(11, 2, "tight"), (12, 2, "roomy"), (13, 4, "tight"), (14, 3, "tight")]
)
def test_transfers_over_the_stand_in_nccl_match_the_reference(monkeypatch, seed, gpus, mode):
    """Both directions of a pair at once (2 GPUs) and many pairs (3, 4 GPUs), over runs: outputs
    as the reference; every transfer went through its channel, each channel's operations all
    from its own thread (the stand-in asserts it), every pair connected at load time."""
    tg = random_taskgraph(seed, n=90, gpus=gpus, size=8)
    mg = plan(tg, mode)
    pairs = {(min(v.gpu, v.ins[0].loc.device), max(v.gpu, v.ins[0].loc.device)) for v in mg.vertices
             if v.kind is MKind.TRANSFER}  # fmt: skip
    assert pairs and any(a != b for a, b in pairs)
    eng, world = nccl_engine(monkeypatch, tg, mg)
    try:
        assert len(world.connects) == gpus * (gpus - 1) // 2, "the warm-up connected every pair"
        for run in range(2):
            inputs = random_inputs(tg, run)
            out, _ = eng.run(inputs, RunOptions(delay=(0, 3e-4) if run else None, seed=run, timeout=60))
            ref = evaluate(tg, inputs)
            for k in ref:
                torch.testing.assert_close(out[k], ref[k], rtol=1e-4, atol=1e-4)
        for g, ex in enumerate(eng.execs):
            stats = ex.transport.statistics()
            assert stats["nccl"]["operations"] == 2 * _transfers(mg, g), stats
            assert stats["nccl"]["error"] is None
            assert set(stats["paths"].values()) == {"nccl"}
    finally:
        eng.close()


@pytest.mark.parametrize("remote_errors", [False, True])
def test_a_lost_peer_ends_the_run_naming_it(monkeypatch, remote_errors):
    """gpu:1 dies mid-run (its NCCL rank stops for good, its channel with it). gpu:0's transfers
    from it never complete: its channel fails the run, naming gpu:1, after DISCO_NCCL_TIMEOUT_S
    without progress, or at once when NCCL reports the lost peer."""
    monkeypatch.setenv("DISCO_NCCL_TIMEOUT_S", "1.5")
    tg = random_taskgraph(21, n=90, gpus=2, size=8)
    mg = plan(tg, "tight")
    eng, world = nccl_engine(monkeypatch, tg, mg)
    world.remote_errors = remote_errors
    victim = eng.execs[1]

    def die_before_sending(vid):  # gpu:1 dies before it sends anything to gpu:0
        world.kill(1)
        victim.transport.channel.close()

    monkeypatch.setattr(victim.transport, "completed", die_before_sending)
    try:
        with pytest.raises(RunError) as err:
            eng.run(random_inputs(tg, 0), RunOptions(timeout=WAIT_S))
        msg = str(err.value)
        assert msg.startswith("gpu:0") and "gpu:1" in msg, msg
        if remote_errors:
            assert "NCCL reported an error" in msg, msg
        else:
            assert "gpu:1 is lost or stalled" in msg and "made no progress for 1.5 s" in msg, msg
        assert re.search(r"transfer \d+ (to|from) gpu:1", msg), msg
    finally:
        eng.close()


def test_nccl_channel_timeout_is_read_at_connect(monkeypatch):
    monkeypatch.setenv("DISCO_NCCL_TIMEOUT_S", "7")
    assert transport_cuda.nccl_timeout() == 7.0
    monkeypatch.delenv("DISCO_NCCL_TIMEOUT_S")
    assert transport_cuda.nccl_timeout() == nccl_channel.TIMEOUT_S
