"""One Ray session and one actor pool per test module (starting Ray and actor processes is slow)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def pool():
    from disco_ray.driver.pool import RayPool, loopback_node

    started = not ray.is_initialized()
    if started:
        with loopback_node():  # loopback only, as a private Ray of the pool's (test_ray_loopback.py)
            ray.init(
                address="local",
                num_cpus=2,
                num_gpus=4,
                include_dashboard=False,
                logging_level="WARNING",
                _node_ip_address="127.0.0.1",
            )
    p = RayPool(op_modules=["actors.testops"])
    p.acquire(4)  # the most GPUs any test uses: actors are made once
    yield p
    p.discard()
    if started:
        ray.shutdown()
