"""Learning-rate schedules, as `transformers.get_scheduler` computes them.

Step k (1, 2, ...) runs at `lr * factor(k - 1, total)`: the factor `LambdaLR` applies before its
(k-1)-th `scheduler.step()` in a transformers Trainer, the formulas of `transformers.optimization`:

- constant: 1 (with `warmup` > 0: transformers' constant_with_warmup, a linear ramp from 0 first);
- linear: the ramp over `warmup` steps, then down to 0 at step `total`;
- cosine: the ramp, then half a cosine period from 1 to 0 at step `total`.

The factor reaches the optimizer vertices as a graph input (`workloads.llm.optimize`), so a
schedule never re-plans the step's graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from disco_ray.graph.errors import UsageError


class Schedule(Enum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


@dataclass(frozen=True, slots=True)
class LrSchedule:
    """A schedule's kind and warmup steps (W >= 0)."""

    name: Schedule = Schedule.CONSTANT
    warmup: int = 0

    @classmethod
    def named(cls, name: str, warmup: int = 0) -> LrSchedule:
        """The schedule called `name` (constant, linear, cosine); UsageError naming a bad one."""
        try:
            kind = Schedule(name)
        except ValueError:
            raise UsageError(
                f"learning-rate schedule {name!r} is not one of {', '.join(s.value for s in Schedule)}"
            ) from None
        out = cls(kind, warmup)
        out.check()
        return out

    def check(self) -> None:
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise UsageError(f"warmup steps must be an integer >= 0, got {self.warmup!r}")

    @property
    def hf_name(self) -> str:
        """The name `transformers.get_scheduler` knows this schedule by."""
        if self.name is Schedule.CONSTANT:
            return "constant_with_warmup" if self.warmup else "constant"
        return self.name.value

    def factor(self, done: int, total: int | None) -> float:
        """The factor of step `done + 1` of `total` (None: unknown, for a constant schedule only)."""
        w = self.warmup
        if done < w:
            return float(done) / float(max(1, w))
        if self.name is Schedule.CONSTANT:
            return 1.0
        if total is None:
            raise UsageError(f"a {self.name.value} learning-rate schedule needs the run's total steps")
        if self.name is Schedule.LINEAR:
            return max(0.0, float(total - done) / float(max(1, total - w)))
        progress = float(done - w) / float(max(1, total - w))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
