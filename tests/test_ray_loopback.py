"""A private local Ray listens on loopback only: no TCP port of its processes (GCS, raylet,
workers, agents, metrics) is bound to 0.0.0.0, :: or a non-loopback address (issue #30 item 7)."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.ray
pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

# a private Ray with a pool's actors up (workers included), then the listening sockets of the
# driver and its descendants (Ray's processes are the driver's children and theirs)
SCRIPT = """
import json, psutil
from disco_ray.driver.pool import RayPool
pool = RayPool(address="local", num_cpus=2)
pool.acquire(2)
me = psutil.Process()
pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
names = {}
for pid in pids:
    try:
        names[pid] = psutil.Process(pid).name()
    except psutil.Error:
        pass
listens = [
    [c.laddr.ip, c.laddr.port, names.get(c.pid, "?")]
    for c in psutil.net_connections(kind="tcp")
    if c.status == psutil.CONN_LISTEN and c.pid in pids
]
pool.close()
print(json.dumps(listens))
"""


def loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback (::ffff:127.0.0.1, a dual-stack socket's)."""
    a = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(a, "ipv4_mapped", None)
    return a.is_loopback or (mapped is not None and mapped.is_loopback)


def test_loopback_addresses():
    assert all(loopback(ip) for ip in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"))
    assert not any(loopback(ip) for ip in ("0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2"))


def test_a_private_ray_listens_on_loopback_only():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DISCO_RAY_ADDRESS": "local"}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-3000:]
    listens = json.loads(r.stdout.strip().splitlines()[-1])
    names = {n for _, _, n in listens}
    assert {"gcs_server", "raylet"} <= names, listens  # the check saw Ray's own servers
    exposed = [x for x in listens if not loopback(x[0])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_loopback_node_restores_the_cluster_switch():
    from ray._private import ray_constants

    from disco_ray.driver.pool import loopback_node

    before = ray_constants.ENABLE_RAY_CLUSTER
    with loopback_node():
        assert ray_constants.ENABLE_RAY_CLUSTER is False
    assert ray_constants.ENABLE_RAY_CLUSTER is before
