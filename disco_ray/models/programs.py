"""What a model driver (generation, fine-tuning) holds: a pool of workers and its Programs."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch

from actors.options import STALL_S
from disco_ray.driver.engine_local import LocalPool
from disco_ray.driver.free_memory import CapacityChoice, RelativeCapacity, measure, relative
from disco_ray.driver.program import ENGINES, Program
from disco_ray.graph.dtypes import FLOATS
from disco_ray.graph.errors import UsageError
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.quant import Layout, Quant
from disco_ray.graph.sizes import parse_capacity
from disco_ray.graph.taskgraph import TaskGraph
from planner.capacity import CapacityBounds, host_capacities
from workloads.llm.checkpoint import Checkpoint

log = logging.getLogger("disco_ray")
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
    path: str,
    gpus: int,
    dtype: str | torch.dtype | None,
    engine: str,
    quantize: str | None = None,
    quant_group: int = 64,
    fused_on: str | None = None,
) -> tuple[Checkpoint, str]:
    """The checkpoint at `path`, its config checked to split over `gpus`, and the compute dtype
    (`dtype`, a name or a torch.dtype, checked; None or "auto": the checkpoint's), to run on
    `engine`: what a model driver runs. `quantize` ("int8", "int4" or None) with `quant_group`:
    its decoder layers' linear weights are read quantized (docs/QUANTIZATION.md); `fused_on`
    "cpu": packed in the layout of the `qlinear` op's CPU kernel (inference: it computes in
    bfloat16), else in the portable one."""
    if engine not in ENGINES:
        raise UsageError(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")
    quant = Quant.named(quantize, quant_group)  # bad values refused before the checkpoint is read
    ck = Checkpoint(path)
    quant = ck.quantized(quant).quant  # a quantized checkpoint's own bits and group, checked
    if quant is not None and fused_on == "cpu":
        quant = replace(quant, layout=Layout.CPU)
    ck.config.check_split(gpus)
    if isinstance(dtype, torch.dtype):  # as transformers takes it: torch.float16
        dtype = str(dtype).removeprefix("torch.")
    if dtype == "auto":  # transformers 5's word for the checkpoint's own
        dtype = None
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
    by graph; closing ends the Programs and a pool started here. The subclass sets `gpus` first."""

    gpus: int

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
        self.host_capacity = (
            parse_capacity(host_capacity) if isinstance(host_capacity, str) else host_capacity
        )
        self.auto: RelativeCapacity | None = None  # "auto" / "P%": the free memory measured at start
        asked = relative(capacity)
        if asked is not None:
            hosts = None if self.host_capacity is None else host_capacities(self.host_capacity, self.gpus)
            places = (cluster.get("address"), getattr(pool, "address", None))
            remote = any(a not in (None, "local") for a in places)  # the workers maybe elsewhere
            self.auto = measure(asked, backend=backend, gpus=self.gpus, host_capacity=hosts, remote=remote)
            capacity = [0] * self.gpus  # grown to each graph's need as it is planned (`fit_capacity`)
        self.capacity = parse_capacity(capacity) if isinstance(capacity, str) else capacity
        self.capacity_choice: CapacityChoice | None = None
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

    def fit_capacity(self, tg: TaskGraph, what: str) -> None:
        """With a capacity asked as "auto" or "P%": before `tg` is planned, the capacity grows to
        what it needs (its roomy capacity, at most the budget; `free_memory`), never shrinks, so
        that every graph shares one arena per GPU; the Programs planned smaller are closed (and
        planned again when used). CapacityError when the budget is below the graph's minimum."""
        if self.auto is None:
            return
        choice = self.auto.choose(CapacityBounds.of([tg]), what)
        caps = [int(c) for c in self.capacity] if isinstance(self.capacity, list) else [0] * self.gpus
        grown = [max(c, n) for c, n in zip(caps, choice.capacity)]
        self.capacity_choice = CapacityChoice(self.auto, tuple(grown))
        if grown != caps:
            self._close_programs()
            self.capacity = grown
            log.info("%s, for %s", self.capacity_choice.describe(), what)

    def capacity_limit(self) -> int | list[int]:
        """The most capacity the next plans may have: the budget under "auto" / "P%" (the
        capacity grows to it as graphs need), else the capacity."""
        return list(self.auto.budget) if self.auto is not None else self.capacity

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
