"""The pure side of placement: GPU shares, bundles, transfer paths, summary lines, CLI options."""

from __future__ import annotations

import argparse

import pytest

from disco_ray.driver.placement import (
    PlacementConfig,
    add_cluster_args,
    bundles,
    cluster_kwargs,
    describe,
    gpu_share,
    transfer_pairs,
    transfer_path,
    transfer_paths,
)
from disco_ray.graph.errors import RunError, UsageError
from disco_ray.graph.memgraph import MKind
from disco_ray.graph.trace import format_placement
from tests.runtime_helpers import plan, random_taskgraph


@pytest.mark.parametrize(
    "have, n, backend, requested, want",
    [
        (8, 4, "cpu", None, 1.0),
        (2, 4, "cpu", None, 0.5),
        (3, 4, "cuda", None, 0.75),
        (1, 3, "cpu", None, 0.3333),
        (0, 4, "cpu", None, 0.0),
        (4, 4, "cuda", 0.25, 0.25),
    ],
)
def test_gpu_share(have, n, backend, requested, want):
    share = gpu_share(have, n, backend, requested)
    assert share == want
    assert share * n <= have + 1e-9


def test_gpu_share_refuses_what_cannot_fit():
    with pytest.raises(RunError, match="no GPU for backend 'cuda'"):
        gpu_share(0, 2, "cuda")
    with pytest.raises(RunError, match=r"4 workers x 1.0 GPU need 4 GPUs; the Ray cluster has 2"):
        gpu_share(2, 4, "cuda", 1.0)


def test_bundles_always_ask_for_something():
    assert bundles(2, 1.0) == [{"GPU": 1.0}, {"GPU": 1.0}]
    assert bundles(1, 0.5, 2) == [{"GPU": 0.5, "CPU": 2}]
    (b,) = bundles(1, 0.0)
    assert set(b) == {"CPU"} and 0 < b["CPU"] < 0.01


def test_transfer_path_by_node_and_backend():
    assert transfer_path("a", "a", "cpu") == "object-store"
    assert transfer_path("a", "b", "cpu") == "object-store"
    assert transfer_path("a", "a", "cuda") == "cuda-ipc"
    assert transfer_path("a", "b", "cuda") == "nccl"
    assert transfer_path("a", "b", "cuda", same_process=True) == "same-process"
    paths = transfer_paths(["a", "a", "b"], "cuda")
    assert paths == {
        "0->1": "cuda-ipc",
        "0->2": "nccl",
        "1->0": "cuda-ipc",
        "1->2": "nccl",
        "2->0": "nccl",
        "2->1": "nccl",
    }


def test_describe_names_each_used_pair_and_formats():
    tg = random_taskgraph(7, n=40, gpus=3)
    mg = plan(tg)
    pairs = transfer_pairs(mg)
    assert pairs == sorted({(v.ins[0].loc.device, v.gpu) for v in mg.vertices if v.kind is MKind.TRANSFER})
    assert pairs, "the graph has no transfer"
    info = {
        "strategy": "spread",
        "gpus_per_worker": 0.5,
        "coordinator": {"node_id": "n" * 40, "ip": "10.0.0.1"},
        "workers": [
            {"gpu": g, "node_id": ("n" if g < 2 else "m") * 40, "ip": f"10.0.0.{1 + g // 2}", "bundle": g}
            for g in range(3)
        ],
    }
    d = describe(info, mg, "cuda")
    assert d["nodes"] == 2 and set(d["paths"]) == {f"{a}->{b}" for a, b in pairs}
    for a, b in pairs:
        assert d["paths"][f"{a}->{b}"] == ("cuda-ipc" if (a < 2) == (b < 2) else "nccl")
    assert sum(d["path_counts"].values()) == len(pairs)
    text = "\n".join(format_placement(d))
    assert "placement spread on 2 node(s), 0.5 GPU per worker" in text
    assert "gpu:2 on node1" in text and "10.0.0.2" in text and "transfer paths:" in text


def test_cluster_options():
    p = argparse.ArgumentParser()
    add_cluster_args(p)
    kw = cluster_kwargs(
        p.parse_args(["--address", "auto", "--placement", "spread", "--gpus-per-worker", "0.5"])
    )
    assert kw == {"placement": PlacementConfig("spread", 0.5, 0.0), "address": "auto"}
    assert cluster_kwargs(p.parse_args([])) == {"placement": PlacementConfig(), "address": None}
    with pytest.raises(UsageError, match="gpus_per_worker must be > 0"):
        cluster_kwargs(p.parse_args(["--gpus-per-worker", "0"]))
    with pytest.raises(UsageError, match="unknown placement"):
        PlacementConfig("scatter").validate()


def test_describe_reports_what_the_transports_opened():
    tg = random_taskgraph(8, n=40, gpus=2)
    mg = plan(tg)
    info = {
        "strategy": "pack",
        "gpus_per_worker": 0.5,
        "coordinator": {"node_id": "n" * 40, "ip": "10.0.0.1"},
        "workers": [{"gpu": g, "node_id": "n" * 40, "ip": "10.0.0.1", "bundle": g} for g in range(2)],
    }
    chosen = describe(info, mg, "cuda")["paths"]
    assert chosen and set(chosen.values()) == {"cuda-ipc"}
    fell_back = describe(info, mg, "cuda", {"0-1": "ray"})["paths"]
    assert set(fell_back) == set(chosen) and set(fell_back.values()) == {"object-store"}
    p2p = describe(info, mg, "cuda", {"0-1": "p2p"})
    assert set(p2p["paths"].values()) == {"cuda-p2p"} and p2p["path_counts"] == {"cuda-p2p": len(chosen)}
