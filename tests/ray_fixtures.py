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
def pool(request):
    """A pool of the module's `POOL_GPUS` workers (4 if it names none), made once: the most GPUs
    its Ray tests use, since each worker is a process that imports torch (seconds of CPU)."""
    from disco_ray.driver.pool import RayPool

    with local_ray(4):
        p = RayPool(op_modules=["actors.testops"])
        p.acquire(getattr(request.module, "POOL_GPUS", 4))  # more later would remake them all
        yield p
        p.discard()


@pytest.fixture(scope="module")
def ray_address():
    """The address of the module's local Ray (4 logical GPUs) for a subprocess's runs to join
    (`joining`) instead of each starting and stopping a private Ray (seconds each)."""
    with local_ray(4):
        yield ray.get_runtime_context().gcs_address


def joining(address: str) -> dict[str, str]:
    """The environment variables that make a subprocess's runs join the Ray at `address`."""
    # a driver joining a loopback-bound Ray must keep 127.0.0.1 as its own address: Ray would take
    # the host's reachable one and wait for a raylet there (disco_ray.driver.pool.loopback_node)
    return {"DISCO_RAY_ADDRESS": address, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
