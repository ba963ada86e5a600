"""Capacities asked relative to the device's free memory: "auto" and a share such as "60%".

    asked = measure("auto", backend="cuda", gpus=2)     # the free memory of each GPU, measured now
    choice = asked.choose(CapacityBounds.of([tg]))      # the capacity for this graph, per GPU
    choice.capacity, choice.describe()                  # bytes per GPU, and a line saying why

Free memory, per GPU: on cuda `torch.cuda.mem_get_info` of each device; on the cpu backend (the
logical GPUs' arenas are host memory) the `host_capacity` budget when one is given, else the
memory this process may still use (`host_available`: /proc/meminfo's MemAvailable, lowered to
what the memory cgroup leaves) divided among the GPUs.

"auto" keeps a margin back: `MARGIN` of the free memory, for what runs outside the arena (torch's
temporaries, the workers' interpreters, other processes' growth), and on cuda `CUDA_RESERVE` more
per GPU for each worker's CUDA context and cuBLAS workspace, which exist only once the workers
start (after the measurement). "P%" is P percent of the free memory, no margin: the share is the
caller's margin. Either is never above the graph's roomy capacity (the arena would hold nothing
more; it is allocated whole) and never below its minimum (an error naming both numbers).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from disco_ray.graph.errors import CapacityError, UsageError
from disco_ray.graph.sizes import format_size
from planner.capacity import ALIGN, CapacityBounds

AUTO = "auto"
MARGIN = 0.10  # of the free memory, kept back by "auto"
CUDA_RESERVE = 512 << 20  # per GPU on cuda: a worker's CUDA context (~300-500 MiB) and cuBLAS workspace
_SHARE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*%\s*")


def relative(capacity: object) -> str | None:
    """ "auto" or "P%" (normalised) when `capacity` asks for a share of the free memory, else None.

    Raises:
        UsageError: a share outside (0, 100] percent, naming it.
    """
    if not isinstance(capacity, str):
        return None
    text = capacity.strip()
    if text.lower() == AUTO:
        return AUTO
    if not text.endswith("%"):
        return None
    m = _SHARE.fullmatch(text)
    try:
        share = Decimal(m.group(1)) if m else None
    except InvalidOperation:
        share = None
    if share is None or not 0 < share <= 100:
        raise UsageError(f"capacity {text!r}: a share of the free memory must be a percentage in (0, 100]")
    return f"{share.normalize():f}%"


@dataclass(frozen=True, slots=True)
class FreeMemory:
    """Bytes free per GPU, and where the numbers come from (for the run's statistics)."""

    per_gpu: tuple[int, ...]
    source: str


def host_available(root: Path = Path("/")) -> tuple[int, str] | None:
    """(bytes this process may still allocate, how that was read): MemAvailable, lowered to the
    memory cgroup's limit less its usage when that is less; None where neither can be read.
    `root`: where /proc and /sys are (a test's own tree)."""
    found: list[tuple[int, str]] = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    if not found:  # no /proc: the pages free now
        with contextlib.suppress(ValueError, OSError, AttributeError):
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages"))
    left = _cgroup_left(root)
    if left is not None:
        found.append((left, "the memory cgroup's limit less its usage"))
    return min(found) if found else None


def _cgroup_left(root: Path) -> int | None:
    """The memory cgroup's limit less its usage (v2, else v1); None without a limit."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    own = {ctl: path.lstrip("/") for _, ctl, path in (ln.split(":", 2) for ln in lines if ln.count(":") >= 2)}
    v2, v1 = own.get("", ""), next((p for c, p in own.items() if "memory" in c.split(",")), "")
    candidates = [  # the process's own cgroup, then the namespace's root (a container's)
        *((root / "sys/fs/cgroup" / d, "memory.max", "memory.current") for d in (v2, "")),
        *(
            (root / "sys/fs/cgroup/memory" / d, "memory.limit_in_bytes", "memory.usage_in_bytes")
            for d in (v1, "")
        ),
    ]
    for base, limit_file, usage_file in candidates:
        try:
            limit = (base / limit_file).read_text().strip()
            usage = int((base / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max", or v1's "no limit"
            return None
        return max(0, int(limit) - usage)
    return None


def free_memory(
    backend: str,
    gpus: int,
    host_capacity: int | list[int | None] | None = None,
    remote: bool = False,
    asked: str = AUTO,
) -> FreeMemory:
    """Each GPU's free memory now (see the module docstring for the sources); `asked`: what the
    capacity was asked as, for the messages.

    Raises:
        UsageError: the memory cannot be measured from this process (cuda not visible here, fewer
            devices than `gpus`, a cluster on another machine), naming what to give instead.
    """
    if backend == "cuda":
        import torch

        if remote:
            raise UsageError(
                f"capacity {asked}: the workers run on a cluster elsewhere, whose CUDA devices this "
                "process cannot measure; give the capacity as a size (e.g. 20GiB)"
            )
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if seen < gpus:
            raise UsageError(
                f"capacity {asked}: {gpus} CUDA device(s) to measure, {seen} visible to this process; "
                "give the capacity as a size (e.g. 20GiB)"
            )
        free = tuple(torch.cuda.mem_get_info(d)[0] for d in range(gpus))
        return FreeMemory(free, "torch.cuda.mem_get_info")
    hosts = host_capacity if isinstance(host_capacity, list) else [host_capacity] * gpus
    if all(h is not None for h in hosts):
        return FreeMemory(tuple(int(h) for h in hosts if h is not None), "host_capacity")
    got = None if remote else host_available()
    if got is None:
        raise UsageError(
            f"capacity {asked}: this process cannot tell the workers' free memory "
            f"({'a cluster on another machine' if remote else 'the OS does not say'}); give a size "
            "or a host_capacity budget"
        )
    each = got[0] // gpus
    free = tuple(each if h is None else int(h) for h in hosts)
    return FreeMemory(free, f"{got[1]} {format_size(got[0])} / {gpus} GPU(s)")


@dataclass(frozen=True, slots=True)
class RelativeCapacity:
    """A capacity asked as "auto" or "P%", with the free memory it is a share of."""

    asked: str  # "auto" or "P%"
    free: FreeMemory
    budget: tuple[int, ...]  # per GPU: the free memory less the margin ("auto"), or the share
    margin: tuple[int, ...]  # per GPU: the bytes "auto" keeps back (0 for a share)

    @classmethod
    def of(cls, asked: str, free: FreeMemory, backend: str = "cpu") -> RelativeCapacity:
        if asked == AUTO:
            reserve = CUDA_RESERVE if backend == "cuda" else 0
            margin = tuple(int(MARGIN * f) + reserve for f in free.per_gpu)
            budget = tuple(max(0, f - m) for f, m in zip(free.per_gpu, margin))
        else:
            share = Decimal(asked[:-1]) / 100
            margin = tuple(0 for _ in free.per_gpu)
            budget = tuple(int(share * f) for f in free.per_gpu)
        return cls(asked, free, tuple(b // ALIGN * ALIGN for b in budget), margin)

    def choose(self, bounds: CapacityBounds, what: str = "the plan") -> CapacityChoice:
        """Per GPU, the budget capped at `bounds.roomy`.

        Raises:
            CapacityError: a GPU's budget below `bounds.min`, naming the GPU and both numbers.
        """
        for g, (b, m) in enumerate(zip(self.budget, bounds.min)):
            if b < m:
                raise CapacityError(
                    f"capacity {self.asked}: {format_size(b)} for gpu {g} ({self._origin(g)}) is below "
                    f"the least {what} works with, {format_size(m)} ({m} bytes): free memory, or give "
                    "a smaller graph"
                )
        caps = tuple(min(b, r) for b, r in zip(self.budget, bounds.roomy))
        return CapacityChoice(self, caps)

    def _origin(self, g: int) -> str:
        """How gpu `g`'s budget came out of its free memory, for a message."""
        free = f"{format_size(self.free.per_gpu[g])} free by {self.free.source}"
        if self.asked != AUTO:
            return f"{self.asked} of {free}"
        return f"{free}, less a {format_size(self.margin[g])} margin"


@dataclass(frozen=True, slots=True)
class CapacityChoice:
    """The capacity chosen for a relative request: per GPU, its budget or the roomy capacity."""

    request: RelativeCapacity
    capacity: tuple[int, ...]

    def statistics(self) -> dict:
        r = self.request
        return {
            "asked": r.asked,
            "capacity": list(self.capacity),
            "free": list(r.free.per_gpu),
            "source": r.free.source,
            "margin": list(r.margin),
            "budget": list(r.budget),
            "capped_at_roomy": [c < b for c, b in zip(self.capacity, r.budget)],
        }

    def describe(self) -> str:
        """One line: what was chosen, from what."""
        r = self.request
        caps = self.capacity if len(set(self.capacity)) > 1 else self.capacity[:1]
        chosen = ", ".join(format_size(c) for c in caps)  # one per GPU where they differ
        capped = any(c < b for c, b in zip(self.capacity, r.budget))
        return (
            f"capacity {r.asked}: {chosen} per GPU ({r._origin(0)}"
            + ("; capped at the roomy capacity: nothing needs more" if capped else "")
            + ")"
        )


def measure(
    asked: str,
    *,
    backend: str,
    gpus: int,
    host_capacity: int | list[int | None] | None = None,
    remote: bool = False,
) -> RelativeCapacity:
    """`asked` ("auto" or "P%", see `relative`) against each GPU's free memory now."""
    return RelativeCapacity.of(asked, free_memory(backend, gpus, host_capacity, remote, asked), backend)
