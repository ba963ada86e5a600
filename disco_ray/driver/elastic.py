"""Elastic capacity: where a running job learns that its GPU memory budget changed.

ElasticFlexGen's design (`../shared/papers/elastic-flexgen-report.md`): a low-priority inference
job gives GPU memory back to others while it keeps running, and takes it again later. The job
looks for a new budget between steps (for generation: between decode steps), finishes the step
in flight, re-plans for the new capacity (plans are cached by capacity), frees or grows its
arena, and goes on. Here a budget comes from:

- a file (`BudgetFile`), holding the per-GPU capacity as `disco-ray` writes sizes ("6GiB", or
  one size per GPU "6GiB,4GiB"), re-read when its modification time changes;
- a named Ray actor (`BudgetActor`, found with `budget_actor(name)`), which another job, on the
  same Ray cluster, calls: `ray.get_actor("disco-budget-NAME").request.remote("4GiB")`.

`Budget` is the pure part both share: the capacity last asked for and when. A budget never ends
a run: a file that goes bad keeps the last good budget (`BudgetFile`), and a request above the
device's memory (`device_memory`) is clamped to it (`fit_budget`), each with one warning.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from disco_ray.graph.errors import UsageError
from disco_ray.graph.sizes import format_size, parse_capacity

ACTOR_PREFIX = "disco-budget-"
log = logging.getLogger("disco_ray")


def _sizes(capacity: int | list[int] | None) -> str:
    if capacity is None:
        return "(none yet)"
    return ",".join(format_size(c) for c in capacity) if isinstance(capacity, list) else format_size(capacity)


@dataclass(slots=True)
class Budget:
    """The capacity a job was last asked to run within (None: unchanged since it started)."""

    capacity: int | list[int] | None = None
    asked_at: float = 0.0  # time.time() of the request
    seq: int = 0  # counts requests

    def request(self, capacity: int | str | list[int]) -> None:
        self.capacity = parse_capacity(capacity) if isinstance(capacity, str) else capacity
        self.asked_at = time.time()
        self.seq += 1

    def since(self, seq: int) -> tuple[int | list[int], float, int] | None:
        """(capacity, asked at, seq) if a request came after request number `seq`, else None."""
        if self.seq == seq or self.capacity is None:
            return None
        return self.capacity, self.asked_at, self.seq


class BudgetFile:
    """A budget held in a file; `poll` re-reads it when the file changed.

    The first read (at start) must succeed: a missing, unreadable or malformed file is a
    UsageError. Later, a file that is deleted, unreadable, not UTF-8 or not a size keeps the last
    good budget and logs one warning naming the file and what it held, once per distinct bad
    content (not once per step): a budget file is edited by hand or by another job while a long
    generation runs, and a typo there must not end it.
    """

    def __init__(self, path: str):
        self.path = path
        self.name = f"--budget-file {path}"  # how warnings name it
        self.warned: set[str] = set()  # the clamps and refusals warned about (`fit_budget`), once each
        self._mtime: int | None = None
        self._bad: str | None = None  # the last bad content warned about
        self.budget = Budget()
        problem = self._read()
        if problem is not None:
            raise UsageError(f"--budget-file {self.path}: {problem}")

    def poll(self) -> Budget:
        """The budget, re-read if the file changed; a bad file keeps the last good one (warned)."""
        problem = self._read()
        if problem is None:
            self._bad = None
        elif problem != self._bad:
            self._bad = problem
            log.warning(
                "%s: %s; keeping the last good budget %s",
                self.name,
                problem,
                _sizes(self.budget.capacity),
            )
        return self.budget

    def _read(self) -> str | None:
        """Reads the file if it changed: None if it was unchanged or good, else what is wrong."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            self._mtime = None  # read again once it is back, whatever its time
            return f"cannot read ({e.strerror})"
        if st.st_mtime_ns == self._mtime:
            return None if self._bad is None else self._bad
        self._mtime = st.st_mtime_ns
        try:
            raw = Path(self.path).read_bytes()
        except OSError as e:
            return f"cannot read ({e.strerror})"
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            return f"not UTF-8 text (byte {e.start} of {raw[:40]!r})"
        try:
            capacity = parse_capacity(text)
        except UsageError as e:
            return str(e) if text else "empty"
        self.budget.request(capacity)
        self.budget.asked_at = st.st_mtime_ns / 1e9  # the request is the file's change
        return None


def device_memory(backend: str, gpus: int) -> int | None:
    """The bytes one GPU's arena can have at most on this machine: on the cpu backend the memory
    free now, shared by the `gpus` logical GPUs; on cuda the smallest visible device's total
    memory; None where this process cannot tell (cuda not visible here)."""
    if backend == "cpu":
        from workloads import available_memory

        free = available_memory()
        return None if free is None else free // gpus
    import torch

    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(d).total_memory for d in range(torch.cuda.device_count()))


def fit_budget(
    capacity: int | list[int], gpus: int, limit: int | None, name: str, warned: set[str] | None = None
) -> int | list[int] | None:
    """What a model on `gpus` GPUs of `limit` bytes each (None: unknown) runs at when `name`, a
    budget, asks for `capacity`: sizes above the limit clamped to it (a warning), or None (keep
    the current capacity, a warning) when it gives neither one size nor one per GPU. `warned`:
    the warnings given already, each given once (a `BudgetFile`'s, read at start and at polls)."""
    sizes = capacity if isinstance(capacity, list) else [capacity]
    if len(sizes) not in (1, gpus):
        _warn(
            f"{name}: {_sizes(capacity)} gives {len(sizes)} sizes for {gpus} GPU(s); keeping the current capacity",
            warned,
        )
        return None
    if limit is None or max(sizes) <= limit:
        return capacity
    _warn(
        f"{name}: {_sizes(capacity)} is above the device's memory ({format_size(limit)} per GPU); clamped to it",
        warned,
    )
    clamped = [min(c, limit) for c in sizes]
    return clamped if isinstance(capacity, list) else clamped[0]


def _warn(message: str, warned: set[str] | None) -> None:
    if warned is None or message not in warned:
        log.warning("%s", message)
    if warned is not None:
        warned.add(message)


class BudgetActor:
    """The Ray actor shell of a `Budget`: another job calls `request`, the running one `since`."""

    def __init__(self) -> None:
        self.budget = Budget()

    def request(self, capacity: int | str | list[int]) -> int:
        self.budget.request(capacity)
        return self.budget.seq

    def since(self, seq: int):
        return self.budget.since(seq)


def budget_actor(name: str):
    """The named budget actor `disco-budget-NAME` on the connected Ray (made if missing)."""
    import ray

    return ray.remote(BudgetActor).options(name=ACTOR_PREFIX + name, get_if_exists=True, num_cpus=0).remote()
