"""What one worker's input loads read in a run, and which loads a run can skip.

Three kinds of graph inputs reach a worker's arena through its input (and input-reload) vertices:
- the caller's inputs, handed in at each run's `begin`. On a backend that stages inputs (cuda)
  they are copied into one pinned buffer made when the graph is loaded, so the H2D copies run at
  full speed. A run may leave out an input an earlier run handed in: the worker keeps its copy
  (a version per copy), so unchanged inputs such as weights cross Ray and the host once;
- sourced inputs (a block of a safetensors file) and states (saved by earlier runs): the
  worker's own, held by its `actors.tiers.store.WorkerStore` across graphs and runs.
Stable loads are the loads of such values into arena ranges no other vertex of this GPU writes:
at the end of a successful run the range still holds the value, so a later run that loads the
same value (the same source, the same version of a state or of a caller's copy) skips the load,
and the value stays on the GPU between runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import numpy as np
import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import MemGraph
from disco_ray.graph.taskgraph import TaskGraph

from .plans import PlanKind, VertexPlan
from .tiers.diskio import Streams
from .tiers.store import ArenaSlot, State, WorkerStore, source_key

_versions = itertools.count(1)  # versions of caller inputs' copies, unique in this process


class Loads:
    """The inputs of graph `tg` on the GPU of `store` (`plans`: its vertices), read from `store`;
    `alloc` makes the staging buffer when `stage` (the backend's allocator and `stages_inputs`)."""

    def __init__(
        self,
        mg: MemGraph,
        tg: TaskGraph,
        plans: Mapping[int, VertexPlan],
        store: WorkerStore,
        alloc: Callable[[int, bool], torch.Tensor],
        stage: bool,
        stream: bool = False,
    ):
        """`stream`: read sourced inputs from their files at each load (actors/tiers/diskio.py)
        instead of keeping them in host memory."""
        self.gpu, self.tg, self.plans, self.store = store.gpu, tg, plans, store
        loaded = {p.value for p in plans.values() if p.kind in (PlanKind.INPUT, PlanKind.RELOAD_INPUT)}
        sourced = sorted(x for x in loaded if tg[x].source is not None)
        self.streams = Streams([tg[x] for x in sourced], store.reader, alloc) if stream else None
        # the caller hands in these; sourced inputs and states are the worker's own
        self.caller = sorted(x for x in loaded if tg[x].from_caller)
        self.given: dict[str, int] = {}  # caller input -> the version of the copy held
        self.inputs: dict[str, torch.Tensor] = {}  # value -> its uint8 host bytes, this run
        self.states: dict[str, State] = {}
        self._acquired: list[str] = []
        try:
            for x in sorted(loaded - set(self.caller)):
                if self.streams is not None and x in self.streams:
                    continue
                if tg[x].source is not None:
                    self.inputs[x] = store.acquire(tg[x])
                    self._acquired.append(x)
                else:
                    self.states[x] = store.state(x, tg[x].nbytes, tg[x].dtype)
        except BaseException:
            self.release()
            raise
        self.stable = stable_loads(mg, self.gpu, plans, set(loaded))
        self._state_sizes = [(x, tg[x].nbytes, tg[x].dtype) for x in self.states]
        # (vid, its range, its value, the token when sourced: the same at every run)
        self._stable = [
            (vid, (p.out_loc.offset, p.out_loc.nbytes), p.value, self._fixed_token(p.value))
            for vid in self.stable
            for p in (plans[vid],)
        ]
        self.tokens: dict[
            tuple[int, int], tuple
        ] = {}  # (offset, bytes) -> the value a stable load puts there
        self._slots: dict[str, tuple[int, int]] = {}  # caller input -> (offset, bytes) in `staging`
        self.staging: torch.Tensor | None = None
        if stage:
            top = 0
            for name in self.caller:
                self._slots[name] = (top, tg[name].nbytes)
                top += -(-tg[name].nbytes // 256) * 256
            self.staging = alloc(top, True)

    def begin(self, inputs: Mapping[str, torch.Tensor], slot: ArenaSlot) -> frozenset[int]:
        """Takes this run's caller inputs (a copy into the staging buffer where there is one; one
        left out is the copy held from an earlier run) and returns the loads to skip: those whose
        range in `slot` still holds the same value. What this run leaves in the arena is
        recorded by `end`."""
        for name in self.caller:
            if name not in inputs:
                if name not in self.given:
                    raise RunError(f"gpu:{self.gpu}: input {name!r} was not handed to this worker")
                continue
            flat = input_bytes(inputs[name])
            nb = self.tg[name].nbytes  # checked once here, not at every load of it
            if flat.numel() != nb:
                raise RunError(f"gpu:{self.gpu}: input {name!r} has {flat.numel()} bytes, not {nb}")
            if self.staging is not None:
                off, _ = self._slots[name]
                flat = self.staging[off : off + nb].copy_(flat)
            self.inputs[name] = flat
            self.given[name] = next(_versions)
        state = self.store.state
        for x, nbytes, dtype in self._state_sizes:  # by id at each run: states move and go (move_states)
            self.states[x] = state(x, nbytes, dtype)
        self.tokens = tokens = {}
        skip = []
        holds = slot.holds
        for vid, where, x, fixed in self._stable:
            tokens[where] = token = fixed or self._token(x)
            if holds.get(where) == token:
                skip.append(vid)
        self.store.loads_skipped += len(skip)
        slot.holds = {}  # this run writes the arena: only its own end says what it holds
        return frozenset(skip)

    def load(self, value: str, out: torch.Tensor, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Fills `out` (an input's arena range) with input `value`: from its file when streamed,
        else with `copy` from its host bytes."""
        if self.streams is not None and value in self.streams:
            self.streams.load(value, out)
        elif value in self.states:
            copy(out, self.states[value].buf)
        else:
            copy(out, self.inputs[value])

    def _fixed_token(self, x: str) -> tuple | None:
        """The token of a sourced input (its source, whatever the run), else None."""
        if x in self.caller or x in self.states:
            return None
        return ("source", source_key(self.tg[x]))

    def _token(self, x: str) -> tuple:
        """What value `x` is in this run: its source, the version of its state or of its copy."""
        if x in self.given:
            return ("caller", x, self.given[x])
        st = self.states.get(x)
        return ("state", x, st.version) if st is not None else ("source", source_key(self.tg[x]))

    def kept(self, where: tuple[int, int], x: str, state: State) -> None:
        """The stable load range `where` holds the current version of state `x` (`state`) now:
        the worker wrote the bytes a run changed into it (`Executor._end_run`)."""
        if self.states.get(x) is state:
            self.tokens[where] = ("state", x, state.version)

    def end(self, slot: ArenaSlot) -> None:
        """The run succeeded: its stable loads' ranges hold their values now."""
        slot.holds = self.tokens

    def release(self) -> None:
        """The graph is unloaded: the store may drop sourced inputs nobody else reads, and no view
        of the arena stays here (the arena's memory goes back with its last view)."""
        for x in self._acquired:
            self.store.release(self.tg[x])
        self._acquired = []
        self.plans = {}


def input_bytes(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The bytes of a caller's input, flat uint8: a tensor, or the numpy bytes the ray engine
    ships small inputs as (`disco_ray.driver.engine_ray.shippable`); one Ray handed over
    read-only is copied (a few bytes: only small inputs travel as numpy)."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x if x.flags.writeable else x.copy()).reshape(-1).view(torch.uint8)
    return torch.as_tensor(x).detach().contiguous().reshape(-1).view(torch.uint8)


def stable_loads(mg: MemGraph, gpu: int, plans: Mapping[int, VertexPlan], values: set[str]) -> list[int]:
    """The input loads of `values` whose arena range no other vertex of this GPU writes: at the
    end of a run the range still holds the value."""
    writes = sorted(
        (p.out_loc.offset, p.out_loc.end, vid)
        for vid, p in plans.items()
        if p.out_loc.device == gpu and p.out_loc.nbytes > 0
    )
    out = []
    reach = -1  # the furthest end of the ranges before this one
    for n, (off, end, vid) in enumerate(writes):
        p = plans[vid]
        alone = reach <= off and (n + 1 == len(writes) or writes[n + 1][0] >= end)
        if alone and p.kind is PlanKind.INPUT and p.value in values:
            out.append(vid)
        reach = max(reach, end)
    return sorted(out)
