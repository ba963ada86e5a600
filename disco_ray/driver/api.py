"""Plan and run in one call: `compile` (plan a TaskGraph into a `Program`), `run` (plan, run once,
clean up), `run_memgraph` (run a given plan once).

    out = disco_ray.driver.api.run(tg, inputs, capacity=64 << 20)              # plan + run + clean up
    prog = disco_ray.driver.api.compile(tg, capacity=64 << 20, engine="ray")  # plan once ...
    out = prog.run(inputs); out2 = prog.run(other_inputs); prog.close()  # ... run many times
    out = disco_ray.driver.api.run_memgraph(tg, mg, inputs)                   # a given plan
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Literal, overload

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.reference import check_inputs
from disco_ray.graph.taskgraph import TaskGraph

from .program import RUN_KEYS, Capacity, Program, RunResult

log = logging.getLogger("disco_ray")


def compile(
    tg: TaskGraph,
    capacity: Capacity = None,
    *,
    order: Sequence[str] | None = None,
    alignment: int = 256,
    host_capacity: int | str | Sequence[int | None] | None = None,
    **kw,
) -> Program:
    """Plans `tg` with planner.build_memgraph for `capacity` bytes per GPU; `kw` go to Program.

    `capacity`: None (everything fits), a size per GPU, or "auto" / "P%" of each GPU's free
    memory on the engine `kw` names (`free_memory`; the choice in `prog.capacity_choice`).

    `host_capacity`: each GPU's host-store budget (the same forms as `capacity`; None: unbounded);
    offloads beyond it go to the worker's spill file (`disk_dir=`, a Program option)."""
    try:
        from planner import build_memgraph, roomy_capacity  # type: ignore[attr-defined]
    except ImportError:
        raise RunError("planner.build_memgraph is not available in this build") from None
    from disco_ray.graph.sizes import parse_capacity

    from .free_memory import relative

    if isinstance(host_capacity, str):
        host_capacity = parse_capacity(host_capacity)
    choice = None
    if capacity is None:
        capacity = roomy_capacity(tg, alignment)
    elif relative(capacity) is not None:  # "auto" or "60%" of the free memory
        choice = _relative_choice(tg, str(capacity), alignment, host_capacity, kw)
        capacity = list(choice.capacity)
        log.info("%s", choice.describe())
    elif isinstance(capacity, str):  # "64MiB", or one size per GPU: "64MiB,32MiB"
        capacity = parse_capacity(capacity)
    mg = build_memgraph(tg, capacity, order=order, alignment=alignment, host_capacity=host_capacity)
    prog = Program(tg, mg, **kw)
    prog._order, prog._alignment, prog._host_capacity = order, alignment, host_capacity
    prog.capacity_choice = choice
    return prog


def _relative_choice(tg: TaskGraph, asked: str, alignment: int, host_capacity, kw: dict):
    """The `CapacityChoice` of "auto" or "P%" for `tg` on the engine `kw` describes."""
    from planner.capacity import CapacityBounds, host_capacities

    from .free_memory import measure, relative

    hosts = None if host_capacity is None else host_capacities(host_capacity, tg.gpus)  # type: ignore[arg-type]
    remote = kw.get("address") not in (None, "local")
    request = measure(
        relative(asked) or asked,
        backend=kw.get("backend", "cpu"),
        gpus=tg.gpus,
        host_capacity=hosts,
        remote=remote,
    )
    return request.choose(CapacityBounds.of([tg], alignment))


@overload
def run_memgraph(
    tg: TaskGraph, mg: MemGraph, inputs: Mapping[str, object], *, details: Literal[False] = False, **kw
) -> dict[str, torch.Tensor]: ...


@overload
def run_memgraph(
    tg: TaskGraph, mg: MemGraph, inputs: Mapping[str, object], *, details: Literal[True], **kw
) -> RunResult: ...


@overload
def run_memgraph(
    tg: TaskGraph, mg: MemGraph, inputs: Mapping[str, object], *, details: bool, **kw
) -> dict[str, torch.Tensor] | RunResult: ...


def run_memgraph(
    tg: TaskGraph, mg: MemGraph, inputs: Mapping[str, object], *, details: bool = False, **kw
) -> dict[str, torch.Tensor] | RunResult:
    """Runs a given plan once and cleans up; `kw`: Program's options and `Program.run`'s (trace,
    check, ...); `details=True`: a `RunResult` (outputs, plan, statistics)."""
    run_kw = {k: kw.pop(k) for k in RUN_KEYS if k in kw}
    with Program(tg, mg, **kw) as prog:
        return prog.run(inputs, details=details, **run_kw)


@overload
def run(
    tg: TaskGraph,
    inputs: Mapping[str, object],
    capacity: Capacity = None,
    *,
    details: Literal[False] = False,
    **kw,
) -> dict[str, torch.Tensor]: ...


@overload
def run(
    tg: TaskGraph, inputs: Mapping[str, object], capacity: Capacity = None, *, details: Literal[True], **kw
) -> RunResult: ...


@overload
def run(
    tg: TaskGraph, inputs: Mapping[str, object], capacity: Capacity = None, *, details: bool, **kw
) -> dict[str, torch.Tensor] | RunResult: ...


def run(
    tg: TaskGraph, inputs: Mapping[str, object], capacity: Capacity = None, *, details: bool = False, **kw
) -> dict[str, torch.Tensor] | RunResult:
    """Plans `tg` for `capacity` bytes per GPU (default: everything fits) and runs it once.

    `kw`: `compile`'s options (order, alignment, host_capacity: the host stores' budget, beyond
    which offloads go to disk), Program's (engine, backend, streams, ...) and `Program.run`'s
    (trace, check, delay, seed, timeout, progress). Inputs are checked before planning, so a bad
    input costs nothing. With `details=True` it returns a `RunResult` (outputs, plan, statistics).
    """
    check_inputs(tg, inputs)
    run_kw = {k: kw.pop(k) for k in RUN_KEYS if k in kw}
    with compile(tg, capacity, **kw) as prog:
        return prog.run(inputs, details=details, **run_kw)
