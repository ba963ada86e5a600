"""One Ray session and one actor pool per test module (starting Ray and actor processes is slow)."""

from __future__ import annotations

import contextlib

import pytest

ray = pytest.importorskip("ray")


@contextlib.contextmanager
def local_ray(gpus: int):
    """A local Ray with `gpus` logical GPUs, bound to loopback as a pool's private one is
    (test_ray_loopback.py), for the block; one already running is used and left running."""
    from disco_ray.driver.pool import loopback_node

    started = not ray.is_initialized()
    if started:
        with loopback_node():
            ray.init(
                address="local",
                num_cpus=2,
                num_gpus=gpus,
                include_dashboard=False,
                logging_level="WARNING",
                _node_ip_address="127.0.0.1",
            )
    try:
        yield
    finally:
        if started:
            ray.shutdown()


@pytest.fixture(scope="module")
def pool():
    from disco_ray.driver.pool import RayPool

    with local_ray(4):
        p = RayPool(op_modules=["actors.testops"])
        p.acquire(4)  # the most GPUs any test uses: actors are made once
        yield p
        p.discard()
