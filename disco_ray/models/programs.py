"""What a model driver (generation, fine-tuning) holds: a pool of workers and its Programs."""

from __future__ import annotations

from typing import Any

from disco_ray.driver.engine_local import LocalPool
from disco_ray.driver.program import Program
from disco_ray.graph.dtypes import FLOATS
from disco_ray.graph.errors import UsageError
from disco_ray.graph.sizes import parse_capacity
from workloads.llm.checkpoint import Checkpoint


def open_checkpoint(path: str, gpus: int, dtype: str | None) -> tuple[Checkpoint, str]:
    """The checkpoint at `path`, its config checked to split over `gpus`, and the compute dtype
    (`dtype`, checked, else the checkpoint's): what a model driver runs."""
    ck = Checkpoint(path)
    ck.config.check_split(gpus)
    if dtype is not None and dtype not in FLOATS:
        raise UsageError(f"dtype {dtype!r} is not one of {', '.join(sorted(FLOATS))}")
    return ck, dtype or ck.config.dtype


class Programs:
    """A pool of workers (given, or started here for `engine`) and the Programs run on it, keyed
    by graph; closing ends the Programs and a pool started here."""

    def __init__(
        self,
        engine: str,
        pool: object | None,
        cluster: dict[str, Any],
        capacity,
        host_capacity,
        **program_kw: Any,
    ):
        """`capacity`, `host_capacity`: as `disco_ray.compile` takes them ("64MiB" strings too)."""
        self.capacity = parse_capacity(capacity) if isinstance(capacity, str) else capacity
        self.host_capacity = (
            parse_capacity(host_capacity) if isinstance(host_capacity, str) else host_capacity
        )
        self.own_pool = pool is None
        if pool is not None:
            self.pool: object = pool
        elif engine == "ray":
            from disco_ray.driver.engine_ray import RayPool

            self.pool = RayPool(**cluster)
        else:
            self.pool = LocalPool()
        self._prog_kw = dict(engine=engine, pool=self.pool, **program_kw)
        self._programs: dict[tuple, tuple[Any, Program]] = {}

    def _close_programs(self) -> None:
        for _, prog in self._programs.values():
            prog.close()
        self._programs.clear()

    def close(self) -> None:
        """Ends every Program and the pool's workers (and a Ray the pool started)."""
        self._close_programs()
        if self.own_pool:
            self.pool.close()  # type: ignore[attr-defined]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
