"""One Ray session and one actor pool per test module (starting Ray and actor processes is slow)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def pool():
    from disco_ray.driver.pool import RayPool

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, logging_level="WARNING")
    p = RayPool(op_modules=["actors.testops"])
    p.acquire(4)  # the most GPUs any test uses: actors are made once
    yield p
    p.discard()
    if started:
        ray.shutdown()
