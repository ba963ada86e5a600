"""One Ray session and one actor pool per test process, shared by its modules (starting Ray and
actor processes is slow)."""

from __future__ import annotations

import contextlib

import pytest

ray = pytest.importorskip("ray")


SHARED_GPUS = 8  # logical GPUs of the shared Ray: the pool's 4 workers and a test's own 4


class _Shared:
    """One local Ray and one actor pool for this test process (each xdist worker has its own),
    started when a module first asks and kept for the next modules: starting Ray and the pool's
    actors (each a process that imports torch) took seconds of CPU per module. A module whose
    tests need no Ray running (they start their own, or check that none runs) stops it
    (`NO_SHARED_RAY = True` at module level, tests/conftest.py)."""

    def __init__(self):
        self.address: str | None = None  # the GCS of the Ray this object started
        self.pool = None

    def ensure(self) -> None:
        """Our Ray running: one a test left behind (a private Ray of `disco_ray.run`) is stopped."""
        from disco_ray.driver.pool import loopback_node

        if ray.is_initialized() and ray.get_runtime_context().gcs_address == self.address:
            return
        self.stop()
        with loopback_node():
            ray.init(
                address="local",
                num_cpus=2,
                num_gpus=SHARED_GPUS,
                include_dashboard=False,
                logging_level="WARNING",
                _node_ip_address="127.0.0.1",
            )
        self.address = ray.get_runtime_context().gcs_address

    def get_pool(self, gpus: int):
        from disco_ray.driver.pool import RayPool

        self.ensure()
        if self.pool is not None and self.pool.workers:
            try:  # an earlier module's fault may have left a worker dead or stopped
                actors = [self.pool.coord, *self.pool.workers]
                ray.get([a.pid.remote() for a in actors], timeout=30)
            except Exception:
                self.pool.discard()
        if self.pool is None:
            self.pool = RayPool(op_modules=["actors.testops"])
        self.pool.acquire(gpus)
        return self.pool

    def stop(self) -> None:
        """No Ray left running in this process: ours, or one a test started (`disco_ray.run`)."""
        import disco_ray

        if self.pool is not None:
            with contextlib.suppress(Exception):  # a Ray already gone: nothing to kill
                self.pool.discard()
            self.pool = None
        disco_ray.shutdown()  # the shared pool of the package's own runs, and its private Ray
        if ray.is_initialized():
            ray.shutdown()
        self.address = None


SHARED = _Shared()


@contextlib.contextmanager
def local_ray(gpus: int):
    """The process's shared local Ray (`SHARED_GPUS` logical GPUs, at least `gpus`), bound to
    loopback as a pool's private one is (test_ray_loopback.py); one already running is used."""
    assert gpus <= SHARED_GPUS
    SHARED.ensure()
    yield


@pytest.fixture(scope="module")
def pool(request):
    """The process's shared pool of 4 workers (the most any module's Ray tests use); its states
    are cleared after the module."""
    p = SHARED.get_pool(4)
    yield p
    with contextlib.suppress(Exception):  # a module that ended with the pool broken: remade next time
        p.clear_states()


@pytest.fixture(scope="module")
def ray_address():
    """The address of the process's shared Ray for a subprocess's runs to join (`joining`)
    instead of each starting and stopping a private Ray (seconds each)."""
    SHARED.ensure()
    yield ray.get_runtime_context().gcs_address


def joining(address: str) -> dict[str, str]:
    """The environment variables that make a subprocess's runs join the Ray at `address`."""
    # a driver joining a loopback-bound Ray must keep 127.0.0.1 as its own address: Ray would take
    # the host's reachable one and wait for a raylet there (disco_ray.driver.pool.loopback_node)
    return {"DISCO_RAY_ADDRESS": address, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
