"""No quiet fallback and no unbounded wait in the transports: a cuda worker pair left on Ray's
object store (no cupy, no NCCL, an arena IPC cannot export) is logged as a warning naming the
pair and why, and shown in the run summary; a pull from a source that never answers ends with an
error naming it, within the run's timeout.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from actors.transports.cuda import connect_workers
from actors.transports.objectstore import RayTransport
from actors.transports.paths import choose_paths, fallback_reason, fallbacks
from disco_ray.driver.placement import describe
from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc
from disco_ray.graph.trace import format_placement
from tests.ray_fixtures import local_ray

NO_NCCL = "cannot import cupy.cuda.nccl (ModuleNotFoundError: No module named 'cupy')"
NO_IPC = "cannot export its arena for CUDA IPC (RuntimeError: expandable segments)"


def info(gpu: int, node: str = "n0", uuid: str | None = None, **kw) -> dict:
    """What a cuda worker's `describe` reports (no peer access, no p2p unless given)."""
    out = {"gpu": gpu, "node": node, "uuid": uuid or f"GPU-{gpu}", "pid": 100 + gpu, "device": gpu}
    out.update(ipc={1 - gpu: "export"}, p2p=False, nccl=True, visible="", peer_access=[], why={})
    out.update(kw)
    return out


# ---- the reasons (pure) -----------------------------------------------------------------------------
def test_each_fallback_names_the_worker_and_what_it_lacks():
    cupy_missing = {"p2p": "cannot import cupy.cuda.runtime (ModuleNotFoundError)", "nccl": NO_NCCL}
    no_cupy = info(1, nccl=False, why=cupy_missing)
    r = fallback_reason(info(0), no_cupy)
    assert "p2p: gpu:0 does not support it, gpu:1 cannot import cupy.cuda.runtime" in r, r
    assert f"nccl: gpu:1 {NO_NCCL}" in r and "gpu:0" not in r.split("nccl:")[1], r
    same_gpu = fallback_reason(info(0, uuid="A"), info(1, uuid="A", ipc=None, why={"ipc": NO_IPC}))
    assert f"ipc: gpu:1 {NO_IPC}" in same_gpu and "NCCL takes one rank per GPU" in same_gpu, same_gpu
    other_node = fallback_reason(info(0), info(1, node="n1"), allow=("ipc", "p2p", "ray"))
    assert other_node == "nccl: left out (DISCO_CUDA_PATHS)", other_node
    p2p = dict(p2p=True, visible="0,1")
    r = fallback_reason(info(0, **p2p, peer_access=[1]), info(1, **p2p, nccl=False, why={"nccl": NO_NCCL}))
    assert "p2p: gpu:1's device cannot access gpu:0's" in r, r


def test_fallbacks_give_every_pair_left_on_ray_its_reason():
    """Three workers: 0 and 1 share GPU A (IPC), 2 has no NCCL: both pairs with 2 fall back;
    with NCCL on 2, pair 1-2 falls back by the one-rank-per-GPU rule, named as such."""
    infos = [info(0, uuid="A"), info(1, uuid="A"), info(2, nccl=False, why={"nccl": NO_NCCL})]
    paths = choose_paths(infos)
    assert paths == {(0, 1): "ipc", (0, 2): "ray", (1, 2): "ray"}
    why = fallbacks(infos, paths)
    assert set(why) == {(0, 2), (1, 2)} and all(f"gpu:2 {NO_NCCL}" in r for r in why.values()), why
    infos[2] = info(2)
    paths = choose_paths(infos)
    why = fallbacks(infos, paths)
    assert paths[(1, 2)] == "ray" and set(why) == {(1, 2)}, (paths, why)
    assert "gpu:1 shares its GPU with gpu:0" in why[(1, 2)], why


def test_the_run_summary_shows_a_fallback_and_why():
    placed = {
        "strategy": "pack",
        "gpus_per_worker": 1,
        "workers": [{"gpu": g, "node_id": "node-a", "ip": "10.0.0.1"} for g in range(2)],
    }

    class Mg:
        gpus = 2
        vertices: list = []

    p = describe(placed, Mg(), "cuda", {"0-1": "ray"}, {"0-1": f"nccl: gpu:1 {NO_NCCL}"})
    text = "\n".join(format_placement(p))
    assert f"0-1 object-store (fallback): nccl: gpu:1 {NO_NCCL}" in text, text


# ---- under Ray: the driver's warning, a silent source ---------------------------------------------
@pytest.fixture(scope="module")
def ray_up():
    with local_ray(2):
        yield


def test_connect_warns_naming_each_pair_left_on_the_object_store(ray_up, caplog):
    """Two workers that cannot share a faster path (gpu:1 has no NCCL): the driver's connect
    returns the pair's reason and logs it as a warning naming the pair."""
    import ray

    @ray.remote(num_cpus=0)
    class Peer:
        def __init__(self, me: dict):
            self.me = me

        def transport_describe(self, key):
            return self.me

        def transport_connect(self, key, infos, paths, uid):
            g = self.me["gpu"]
            return {j if i == g else i: p for (i, j), p in paths.items() if g in (i, j)}

    peers = [
        Peer.remote(info(0, node="n0")),
        Peer.remote(info(1, node="n1", nccl=False, why={"nccl": NO_NCCL})),
    ]
    with caplog.at_level(logging.WARNING, logger="disco_ray"):
        got = connect_workers(peers, "k", timeout_s=60)
    assert got.paths == {"0-1": "ray"}
    assert got.fallbacks == {"0-1": f"nccl: gpu:1 {NO_NCCL}"}, got.fallbacks
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("gpu:0 and gpu:1" in m and "object store" in m and NO_NCCL in m for m in warned), warned


def test_a_source_that_never_answers_ends_the_pull_naming_it(ray_up):
    """gpu:0's read_range never returns: the pull gives up once the run's timeout has passed,
    naming gpu:0 (planted: with ray.get unbounded, the pull is still waiting after WAIT_S)."""
    import ray

    @ray.remote(num_cpus=0)
    class Silent:
        def read_range(self, loc, reader, expect):
            threading.Event().wait()

    tr = RayTransport([Silent.remote(), None])
    tr.set_timeout(1.0)
    err: list = []

    def pull():
        try:
            tr.pull(0, Loc(0, 0, 8), None, 7, 3)  # type: ignore[arg-type]  # never reaches the copy
        except RunError as e:
            err.append(str(e))

    t0 = time.monotonic()
    t = threading.Thread(target=pull, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the pull is still waiting for a source that never answers"
    assert err and "transfer 7" in err[0] and "gpu:0 did not answer" in err[0], err
    assert "the run's timeout of 1 s" in err[0], err
    assert time.monotonic() - t0 < 30
