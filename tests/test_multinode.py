"""Two Ray nodes on this machine (`ray start` head + a second node): placement across nodes, transfers
through the object store between them, link probes, and the loss of a node mid-run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from disco_ray.driver.cluster import measure_links
from disco_ray.driver.placement import PlacementConfig
from disco_ray.driver.program import Program
from disco_ray.graph.errors import RunError
from disco_ray.graph.reference import evaluate, random_inputs
from tests.runtime_helpers import plan, random_taskgraph
from tests.test_runtime_local import assert_same

ray = pytest.importorskip("ray")
from tests.ray_cluster import LocalCluster  # noqa: E402

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.slow]
NO_SHARED_RAY = True  # its tests drive a cluster of their own


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    c = LocalCluster()
    mp = pytest.MonkeyPatch()
    mp.delenv("RAY_ADDRESS", raising=False)
    try:
        c.start_head("node_a").add_node("node_b")
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        left = c.stop()
        mp.undo()
        assert not left, f"processes of the test cluster still running: {left}"


def _nodes(c) -> dict[str, str]:
    """Resource name (node_a/node_b) -> node id."""
    return {
        name: n["NodeID"]
        for n in ray.nodes()
        if n["Alive"]
        for name in ("node_a", "node_b")
        if name in n["Resources"]
    }


def _wait_all_gpus_free(timeout: float = 30.0) -> None:
    """Placement groups of earlier Programs are released asynchronously: SPREAD is best effort and
    would put every bundle on the one node already free."""
    t_end = time.monotonic() + timeout
    while ray.available_resources().get("GPU", 0) < ray.cluster_resources().get("GPU", 0):
        assert time.monotonic() < t_end, f"GPUs still held: {ray.available_resources()}"
        time.sleep(0.2)


def test_both_nodes_joined(cluster):
    assert set(_nodes(cluster)) == {"node_a", "node_b"}
    assert ray.cluster_resources()["GPU"] == 4


def test_graph_spanning_two_nodes_matches_reference_and_links_are_measured(cluster):
    seed = 301
    tg = random_taskgraph(seed, n=40, gpus=4)
    with Program(tg, plan(tg, "tight"), engine="ray", streams=2, placement=PlacementConfig("pack")) as prog:
        for run in range(2):
            inputs = random_inputs(tg, run)
            out = prog.run(inputs, check=True, timeout=120)
            assert_same(out, evaluate(tg, inputs), (seed, run))
        p = prog.last_summary["placement"]
        links = measure_links(prog, nbytes=1 << 20, repeats=2)
    nodes = {w["node_id"] for w in p["workers"]}
    assert len(nodes) == 2 == p["nodes"], p
    assert nodes == set(_nodes(cluster).values())
    assert [w["gpu"] for w in p["workers"]] == [0, 1, 2, 3]
    assert all(w["ip"] for w in p["workers"])
    assert p["coordinator"]["node_id"] == ray.get_runtime_context().get_node_id()
    assert p["paths"] and set(p["paths"].values()) == {"object-store"}, p["paths"]
    # pack: 4 bundles of 1 GPU on nodes of 2 GPUs -> two workers per node
    assert sorted(sum(w["node_id"] == n for w in p["workers"]) for n in nodes) == [2, 2]
    assert len(links["links"]) == 12 and all(ln["gbps"] > 0 for ln in links["links"])
    cross = [ln for ln in links["links"] if ln["src_node"] != ln["dst_node"]]
    assert len(cross) == 8 and {ln["path"] for ln in cross} == {"object-store"}
    assert sorted(len(n["gpus"]) for n in links["nodes"]) == [2, 2]
    assert links["paths"]["object-store"]["links"] == 12


def test_spread_uses_both_nodes_pack_and_fractions_use_one(cluster):
    tg = random_taskgraph(302, n=20, gpus=2)
    mg = plan(tg, "tight")
    inputs = random_inputs(tg, 0)
    ref = evaluate(tg, inputs)
    where = {}
    for name, cfg in {
        "spread": PlacementConfig("spread"),
        "pack-half": PlacementConfig("pack", gpus_per_worker=0.5),
    }.items():
        _wait_all_gpus_free()
        with Program(tg, mg, engine="ray", streams=2, placement=cfg) as prog:
            assert_same(prog.run(inputs, timeout=120), ref, name)
            where[name] = prog.last_summary["placement"]
    assert where["spread"]["nodes"] == 2
    assert where["pack-half"]["nodes"] == 1 and where["pack-half"]["gpus_per_worker"] == 0.5


def test_job_entry_point_connects_by_address_and_spreads(cluster, tmp_path):
    """`python -m disco_ray.cli.job ... --address HOST:PORT` (the `disco-ray run` options) in its own process."""
    from disco_ray.graph import formats

    tg = random_taskgraph(304, n=20, gpus=2)
    formats.save(tg, str(tmp_path / "g.json"))
    _wait_all_gpus_free()
    args = ["--address", cluster.address, "--placement", "spread", "--check-reference"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "disco_ray.cli.job",
            str(tmp_path / "g.json"),
            *args,
            "--out",
            str(tmp_path / "o.npz"),
        ],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "placement spread on 2 node(s)" in r.stdout and "reference: match" in r.stdout, r.stdout
    assert (tmp_path / "o.npz").exists()


def test_bench_against_the_cluster_records_nodes_and_links(cluster, tmp_path):
    """`disco-ray bench --address HOST:PORT`: an existing cluster, per-node and per-link figures in results.json."""
    _wait_all_gpus_free()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "disco_ray",
            "bench",
            "matmul_chain",
            "n=3",
            "gpus=2",
            "tokens=32",
            "hidden=64",
            "--modes",
            "dynamic,levelwise",
            "--capacity",
            "64KiB",
            "--address",
            cluster.address,
            "--placement",
            "spread",
            "--repeat",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
        ],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads((tmp_path / "results.json").read_text())
    links = res["cluster"]
    assert len(links["nodes"]) == 2 and len(links["links"]) == 2, links
    assert all(ln["gbps"] > 0 and ln["path"] == "object-store" for ln in links["links"])
    assert {ln["src_node"] for ln in links["links"]} == {n["node_id"] for n in links["nodes"]}


def test_losing_a_node_mid_run_names_the_lost_worker(cluster):
    """Runs last in this module: node_b is gone afterwards."""
    tg = random_taskgraph(303, n=120, gpus=4)
    prog = Program(tg, plan(tg, "tight"), engine="ray", streams=1)
    node_b = _nodes(cluster)["node_b"]
    try:
        on_b = [w["gpu"] for w in prog.engine.placement_summary["workers"] if w["node_id"] == node_b]
        assert on_b, "no worker on node_b"
        killed = []

        def progress(done: int) -> None:
            if done >= 10 and not killed:
                cluster.kill_node("node_b")
                killed.append(time.monotonic())

        with pytest.raises(RunError) as err:
            # ~30 ms per vertex: the run lasts seconds, the node dies in its middle
            prog.run(random_inputs(tg, 0), delay=(0.02, 0.04), seed=1, timeout=120, progress=progress)
    finally:
        prog.close()
    msg = str(err.value)
    assert killed, "the run ended before the node was killed"
    assert "did not finish within" not in msg, msg
    assert re.search(rf"gpu:({'|'.join(map(str, on_b))})\b", msg), (on_b, msg)
    assert re.search(r"died|lost", msg), msg
    assert time.monotonic() - killed[0] < 60
