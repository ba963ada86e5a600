"""What one vertex's work does on its stream's thread (`VertexWork._one`: a kernel, a copy, a
spill write or read, a transfer, a load), and a unit's: a chain of kernels run back to back
(`actors.worker_core.chains`; docs/RUNTIME.md, "Chains"). The executor (`actors.executor`)
hands `_work` to its backend's stream threads.
"""

from __future__ import annotations

import random
import time

from disco_ray.graph.errors import RunError

from .carries import CarrySaves
from .conditions import Conditions
from .plans import PlanKind, describe
from .resources import GpuResources
from .sanitizer import Sanitizer
from .slots import StreamSlots
from .transports.base import Transport


class VertexWork(GpuResources):
    """The work of this GPU's vertices; what a run sets (`actors.executor.Executor.begin`)."""

    _error: str | None
    _check: bool
    _sanitizer: Sanitizer | None
    _delay: tuple[float, float] | None
    _rng: random.Random
    _cond: Conditions
    _acc_first: dict[int, bool]
    _saves: CarrySaves
    _skip: frozenset[int]
    slots: StreamSlots
    transport: Transport | None
    trace: list[tuple[int, int, int, int]]

    def _work(self, vid: int, s: int) -> None:
        units = self.slots.units
        unit = units.get(vid) if units else None
        if unit is None:
            return self._one(vid, s)
        # a chain's kernels back to back on this stream; each timed here unless enqueued only
        # (async launch: the device times the unit as a whole, `_done`)
        clock, trace, timed = time.time_ns, self.trace, not self.backend.async_launch
        for m in unit:
            t0 = clock() if timed else 0
            try:
                self._one(m, s)
            except BaseException as e:  # `_done` names the kernel that raised
                raise InUnit(m, e) from e
            if timed:
                trace.append((m, s, t0, clock()))

    def _one(self, vid: int, s: int) -> None:
        if self._error is not None:  # the run failed: what was launched ahead is skipped
            return
        p = self.plans[vid]
        san = self._sanitizer if self._check else None
        if san is not None:
            san.before(vid, p.checks, p.out_loc)
        if self._delay is not None:  # inside the write: a writer overlapping it is seen
            time.sleep(self._rng.uniform(*self._delay))
        if vid in self._cond.when and self._cond.skips(vid):
            return  # not flagged: no bytes moved, no kernel run; the sanitizer saw its write
        k = p.kind
        if k is PlanKind.KERNEL and vid in self.core.groups and not self._acc_first[vid]:
            self.backend.kernel("add", p.out, [p.out, p.ins[0]], p.attrs)  # sum-into: add the operand
        elif k is PlanKind.KERNEL:
            self.backend.kernel(p.op, p.out, p.ins, p.attrs)
            if vid in self._cond.writers:  # a flag: which of its columns some row chose
                self._cond.flagged(vid, p.out)
            if vid in self._saves.deltas:  # a carried value's last writer: the bytes it changed
                self._saves.wrote(vid, p)
        elif k is PlanKind.COPY:
            self.backend.copy(p.out, p.ins[0])
        elif k is PlanKind.SPILL:
            self._spill().write(p.out_loc.offset, p.ins[0])
            self._read_ahead().written(vid)
        elif k is PlanKind.UNSPILL:
            assert p.src_loc is not None  # a reload from disk's plan has one
            if not self._read_ahead().take(vid, p.out, self.backend.copy):
                self._spill().read(p.src_loc.offset, p.out, self.backend.copy)
        elif k is PlanKind.TRANSFER:
            if self.transport is None:
                raise RunError(f"gpu:{self.gpu}: no transport for {describe(self.mg, vid)}")
            assert p.src_loc is not None  # a transfer's plan has one
            self.transport.pull(p.src_gpu, p.src_loc, p.out, vid, p.src_vid)
        elif vid not in self._skip:
            self.loads.load(p.value, p.out, self.backend.copy)


class InUnit(Exception):
    """Vertex `vid` of a unit (a chain run as one launch) raised `exc`."""

    def __init__(self, vid: int, exc: BaseException):
        super().__init__(vid, exc)
        self.vid, self.exc = vid, exc
