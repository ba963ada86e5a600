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

`Budget` is the pure part both share: the capacity last asked for and when.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from disco_ray.graph.errors import UsageError
from disco_ray.graph.sizes import parse_capacity

ACTOR_PREFIX = "disco-budget-"


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
    """A budget held in a file; `poll` re-reads it when the file changed."""

    def __init__(self, path: str):
        self.path = path
        self._mtime: int | None = None
        self.budget = Budget()
        self.poll()

    def poll(self) -> Budget:
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise UsageError(f"--budget-file {self.path}: cannot read ({e.strerror})") from None
        if st.st_mtime_ns != self._mtime:
            self._mtime = st.st_mtime_ns
            text = Path(self.path).read_text().strip()
            try:
                self.budget.request(text)
            except UsageError as e:
                raise UsageError(f"--budget-file {self.path}: {e}") from None
            self.budget.asked_at = st.st_mtime_ns / 1e9  # the request is the file's change
        return self.budget


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
