"""How a run saves the carried values of one GPU's plan as their states (`Executor._end_run`).

A carried value (a KV cache block a decode step extends) is saved into its state's host buffer
at the end of each run. When its last writer is an op that changes only a few bytes of its
first input (`disco_ray.graph.kernels.CHANGED`: `kv_write` writes one row per sequence) and
that input is the state itself as this run loaded it, only those bytes are copied: the rest of
the buffer already holds them. The same bytes go into the stable load ranges of that state
(`actors.loads`: ranges no other vertex writes, which still hold the state as loaded), so those
ranges hold the new version and the next run skips the load, as it skips a weight load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from disco_ray.graph.kernels import CHANGED
from disco_ray.graph.memgraph import DISK, Loc, MemGraph

from .loads import Loads
from .plans import PlanKind, VertexPlan
from .tiers.store import State

Carry = tuple[str, int, State]  # (value, the vertex holding it at the end, its state)
Mirror = tuple[tuple[int, int], np.ndarray, str]  # ((offset, bytes), a view of the range, the state)


class CarrySaves:
    """The saves of GPU `mg`'s carried values (`keys`: their states' ids); `range_of(loc, vid)`
    is the executor's view of a range; `async_launch`: the backend's (no byte ranges then: a
    range would cost a sync, so whole values are saved)."""

    def __init__(
        self,
        mg: MemGraph,
        plans: Mapping[int, VertexPlan],
        carries: Sequence[Carry],
        keys: Sequence[str],
        loads: Loads,
        range_of: Callable[[Loc, int], torch.Tensor],
        async_launch: bool,
    ):
        self.loads, self._range = loads, range_of
        self.deltas: frozenset[int] = frozenset(
            vid
            for (_, vid, _), key in zip(carries, keys)
            if not async_launch and _on_its_state(mg, plans, vid, key, loads) and list(keys).count(key) == 1
        )
        # each carried value's bytes as a numpy view, made once (None: not in host memory)
        self.views = [self._host_view(mg.vertex(vid).out, vid) for _, vid, _ in carries]
        self.mirrors: dict[int, list[Mirror]] = {}
        for (_, vid, _), key, view in zip(carries, keys, self.views):
            if vid not in self.deltas or view is None:
                continue
            for u in loads.stable:
                loc = plans[u].out_loc
                if plans[u].value == key and (mirror := self._host_view(loc, u)) is not None:
                    self.mirrors.setdefault(vid, []).append(((loc.offset, loc.nbytes), mirror, key))
        self.changed: dict[int, tuple[int, int]] = {}  # delta writer -> its changed bytes, this run

    def _host_view(self, loc: Loc, vid: int) -> np.ndarray | None:
        """A numpy view of `loc` when it is in host memory (the cpu backend's arena, the host
        store), else None."""
        if loc.device == DISK:
            return None
        buf = self._range(loc, vid)
        return buf.numpy() if buf.device.type == "cpu" else None

    def begin(self) -> None:
        """A new run: no bytes changed yet."""
        self.changed = {}

    def wrote(self, vid: int, p: VertexPlan) -> None:
        """Delta writer `vid` ran (its stream thread, right after its kernel): the bytes it changed."""
        self.changed[vid] = CHANGED[p.op](p.out, p.ins, p.attrs)

    def save(self, carries: Sequence[Carry], mg: MemGraph) -> None:
        """The run succeeded: each carried value into its state (a new version)."""
        changed = self.changed
        for (_, vid, st), view in zip(carries, self.views):
            if view is None:
                src = self._range(mg.vertex(vid).out, vid)
                lo, hi = changed.get(vid, (0, src.numel()))
                save(st.buf[lo:hi], src[lo:hi])
            else:  # a memcpy of numpy views: torch's slicing and copy_ cost 10-20 us each
                lo, hi = changed.get(vid, (0, view.size))
                np.copyto(st.buf.numpy()[lo:hi], view[lo:hi])  # the rest: the state as loaded
            st.version += 1
            if vid in changed:
                for where, mirror, key in self.mirrors.get(vid, ()):
                    assert view is not None  # a mirror is made only for a value with a view
                    np.copyto(mirror[lo:hi], view[lo:hi])
                    self.loads.kept(where, key, st)

    def release(self) -> None:
        """The graph is unloaded: no view of its arena stays."""
        self.views, self.mirrors = [], {}


def _on_its_state(mg: MemGraph, plans: Mapping[int, VertexPlan], vid: int, key: str, loads: Loads) -> bool:
    """Whether carried value writer `vid` is a `CHANGED` kernel whose first input is state `key`
    as loaded (so its output is that state with a few bytes changed)."""
    p, v = plans[vid], mg.vertex(vid)
    return (
        p.kind is PlanKind.KERNEL
        and p.op in CHANGED
        and v.acc is None
        and bool(v.ins)
        and v.ins[0].value == key
        and key in loads.states
    )


def save(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[:] = src` (uint8, same size): one memcpy when both are in host memory (torch's `copy_`
    splits a large copy over its thread pool, which waits for cores on a busy machine)."""
    if src.device.type == "cpu" and dst.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)
