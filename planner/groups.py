"""Sum-into groups (TURNIP appendix A): where an `accumulate`'s members go in the serial order.

An `accumulate` vertex of the TaskGraph becomes one sum-into kernel per operand in the MemGraph,
all writing the sum's range, one at a time, in any order (the runtime's write lock). BUILDMEMGRAPH
simulates them as steps of their own: in the serial order, the accumulate's own step is replaced
by its members. "eager" puts member i right after the step that completes operand i, so each
partial dies at once and the sum's range is held from the first partial on; "deferred" puts all
members at the accumulate's own step (the n-ary add's lifetimes, one partial read at a time).

A member is a step code n + m (n: the TaskGraph's vertex count) in the planner's `seq`.
Rejected: rewriting the TaskGraph into a chain of adds (it orders the members and gives each
partial sum a range of its own, which is what sum-into avoids).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .dense import Dense

MODES = ("eager", "deferred", "off")


class Members:
    """The members of every accumulate: per member m its group `acc[m]`, `part[m]`, operand `x[m]`;
    `first[m]`/`last[m]` in the serial order; per group k, `of[k]` its members in part order.

    `demoted` (accumulate position -> "deferred" | "off") overrides the mode per group: "off"
    leaves the accumulate one kernel."""

    def __init__(self, d: Dense, demoted: Mapping[int, str] | None = None):
        self.demoted = demoted = demoted or {}
        self.n = len(d)
        self.acc: list[int] = []
        self.part: list[int] = []
        self.x: list[int] = []
        self.of: dict[int, list[int]] = {}
        for k, v in enumerate(d.tg):
            ins = d.inputs[k]
            if ins and v.op == "accumulate" and demoted.get(k) != "off":
                ms = self.of[k] = []
                for i, x in enumerate(ins):
                    ms.append(len(self.acc))
                    self.acc.append(k)
                    self.part.append(i)
                    self.x.append(x)
        self.first = [False] * len(self.acc)
        self.last = [False] * len(self.acc)

    def __len__(self) -> int:
        return len(self.acc)

    def parts(self, m: int) -> tuple[int, int]:
        return self.part[m], len(self.of[self.acc[m]])

    def expand(self, seq: Sequence[int], mode: str) -> list[int]:
        """The serial order with every accumulate replaced by its members (codes n + m)."""
        n, of = self.n, self.of
        out: list[int] = []
        waiting: dict[int, list[int]] = {}  # value -> members whose operand it is (eager)
        left = {k: len(ms) for k, ms in of.items()}  # members not placed yet

        def done(v: int) -> None:  # v is complete: its waiting members follow at once
            stack = [v]
            while stack:
                for m in waiting.pop(stack.pop(), ()):
                    out.append(n + m)
                    k = self.acc[m]
                    left[k] -= 1
                    if left[k] == 0:
                        stack.append(k)

        eager = {k for k in of if mode == "eager" and k not in self.demoted}
        for k in eager:
            for m in of[k]:
                waiting.setdefault(self.x[m], []).append(m)
        for k in seq:
            if k in of:
                if k not in eager:
                    out.extend(n + m for m in of[k])
                    left[k] = 0
                    done(k)
                continue
            out.append(k)
            done(k)
        seen: set[int] = set()
        for t in range(len(out) - 1, -1, -1):
            c = out[t]
            if c >= n and self.acc[c - n] not in seen:
                seen.add(self.acc[c - n])
                self.last[c - n] = True
        seen.clear()
        for c in out:
            if c >= n and self.acc[c - n] not in seen:
                seen.add(self.acc[c - n])
                self.first[c - n] = True
        assert len(out) == n - len(of) + len(self), "every member placed once"
        return out
