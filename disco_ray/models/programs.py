"""What a model driver (generation, fine-tuning) holds: a pool of workers and its Programs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from actors.options import STALL_S
from disco_ray.driver.engine_local import LocalPool
from disco_ray.driver.program import ENGINES, Program
from disco_ray.graph.dtypes import FLOATS
from disco_ray.graph.errors import UsageError
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.quant import Quant
from disco_ray.graph.sizes import parse_capacity
from disco_ray.graph.taskgraph import TaskGraph
from workloads.llm.checkpoint import Checkpoint

F = TypeVar("F", bound=Callable[..., Any])


def one_request(method: F) -> F:
    """Holds the pool's lock (`RayPool.lock`) for the whole call: a request's runs share the
    workers' states (a KV cache, an adapter), so another thread's request waits its turn instead
    of mixing its runs in between."""

    @functools.wraps(method)
    def held(self, *args, **kwargs):
        with self.pool.lock:
            return method(self, *args, **kwargs)

    return held  # type: ignore[return-value]


def open_checkpoint(
    path: str, gpus: int, dtype: str | None, engine: str, quantize: str | None = None, quant_group: int = 64
) -> tuple[Checkpoint, str]:
    """The checkpoint at `path`, its config checked to split over `gpus`, and the compute dtype
    (`dtype`, checked, else the checkpoint's), to run on `engine`: what a model driver runs.
    `quantize` ("int8", "int4" or None) with `quant_group`: its decoder layers' linear weights
    are read quantized (docs/QUANTIZATION.md)."""
    if engine not in ENGINES:
        raise UsageError(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")
    quant = Quant.named(quantize, quant_group)  # bad values refused before the checkpoint is read
    ck = Checkpoint(path)
    ck.config.check_split(gpus)
    if dtype is not None and dtype not in FLOATS:
        raise UsageError(f"dtype {dtype!r} is not one of {', '.join(sorted(FLOATS))}")
    return ck.quantized(quant), dtype or ck.config.dtype


def plan_entry(graph: str, tg: TaskGraph, mg: MemGraph, seconds: float, **extra: object) -> dict:
    """What a driver records of one plan: the graph's name, its size, the seconds planning took,
    the bytes the plan moves (and `extra`)."""
    stats = mg.stats
    return {
        "graph": graph,
        "vertices": len(tg),
        "memgraph_vertices": len(mg),
        "planning_s": round(seconds, 4),
        "bytes_offloaded": stats.get("bytes_offloaded", 0),
        "bytes_reloaded": stats.get("bytes_reloaded", 0),
        "bytes_offloaded_disk": stats.get("bytes_offloaded_disk", 0),
        **extra,
    }


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
        backend: str,
        streams: int,
        ahead: int | None,
        weights: str,
        disk_dir: str | None,
        check: bool,
    ):
        """`capacity`, `host_capacity`: as `disco_ray.compile` takes them ("64MiB" strings too);
        the others as `LlamaModel` takes them."""
        self.engine, self.backend, self.check = engine, backend, check
        self.run_kw: dict[str, Any] = {"check": check, "stall_timeout": STALL_S}  # every run's options
        self.capacity = parse_capacity(capacity) if isinstance(capacity, str) else capacity
        self.host_capacity = (
            parse_capacity(host_capacity) if isinstance(host_capacity, str) else host_capacity
        )
        self.own_pool = pool is None
        if pool is not None:
            self.pool: object = pool
        elif engine == "ray":
            from disco_ray.driver.pool import RayPool

            self.pool = RayPool(**cluster)
        else:
            self.pool = LocalPool()
        self._prog_kw: dict[str, Any] = dict(
            engine=engine,
            pool=self.pool,
            backend=backend,
            streams=streams,
            ahead=ahead,
            sources=weights,
            disk_dir=disk_dir,
        )
        self.plans: list[dict] = []  # one entry per plan made (`plan_entry`)
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
