"""What one GPU's worker keeps across graphs and runs: its arena, the graph inputs it read from
their sources, and the states runs save.

A worker may hold several graphs at once (a model's prefill and its decode steps); they share:

- **the arena**: one allocation per capacity (every graph planned for the same capacity uses the
  same bytes; runs are sequential). With it, what the last successful run left in which range:
  a graph input the plan never overwrites stays in the arena after the run, so a later run that
  loads the same value (a weight from the same source, a state of the same version) into the
  same range skips the load. With room for the weights, a model's weights then cross to the GPU
  once, not at every decode step.
- **resident inputs**: the value of each `Source` (a block of a safetensors file), read once when
  the first graph naming it is loaded, kept in host memory (pinned where the backend pins) for
  every graph and run that names it, for as long as the worker lives (`drop_unused` frees those
  no loaded graph names). With sources streamed from disk (`actors.tiers.diskio`) there are none.
- **states**: named values a run saves (`TaskGraph.carry`) and later runs read (`state` inputs),
  for example a KV cache. Each has a version that counts its saves. `move_states` renames and
  drops them between runs without copying data (a batch's finished sequences give their KV cache
  back, the live ones take their rows); an id's version only grows, whatever moved through it,
  so a load is never skipped for a value the arena held under that id before.

Everything is allocated when a graph is loaded, never while a graph runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from disco_ray.graph import sources
from disco_ray.graph.dtypes import torch_dtype
from disco_ray.graph.errors import RunError
from disco_ray.graph.taskgraph import Vertex

from .diskio import FileReader

Alloc = Callable[[int, bool], torch.Tensor]  # (nbytes, host) -> uint8 buffer (a backend's alloc)
Token = tuple  # what an arena range holds: ("source", key) or ("state", id, version)


@dataclass(slots=True)
class ArenaSlot:
    """One arena, and what each range held at the end of the last successful run on it."""

    buf: torch.Tensor
    holds: dict[tuple[int, int], Token] = field(default_factory=dict)  # (offset, nbytes) -> token
    users: int = 0  # graphs loaded on it


@dataclass(slots=True)
class State:
    buf: torch.Tensor  # uint8, host
    version: int = 0  # how many times a run saved it


@dataclass(slots=True)
class _Resident:
    buf: torch.Tensor  # uint8, host
    users: int = 0


def source_key(v: Vertex) -> tuple:
    """Identity of a sourced input's value: the same block read as the same dtype."""
    assert v.source is not None
    return (v.source, v.shape, v.dtype)


class WorkerStore:
    """One per worker (GPU); `alloc` is the backend's allocator (host=True: host memory, pinned
    where the backend pins: then a value read from a source is copied into such a buffer)."""

    def __init__(self, gpu: int, alloc: Alloc, pinned: bool = False):
        self.gpu = gpu
        self._alloc = alloc
        self.pinned = pinned
        self.arenas: dict[int, ArenaSlot] = {}
        self.states: dict[str, State] = {}
        self._gone: dict[str, int] = {}  # a moved or dropped state's last version: ids never reuse one
        self.states_dropped = 0
        self._resident: dict[tuple, _Resident] = {}
        self.bytes_read = 0  # from sources, since the store was made
        self.reader = FileReader()  # streamed sources' reads (actors/tiers/diskio.py)
        self.loads_skipped = 0  # input loads a run did not need (the arena held the value)

    def arena(self, nbytes: int) -> ArenaSlot:
        """The arena of `nbytes` bytes, made on first use and shared by every graph of that capacity;
        each graph that takes it gives it back with `release_arena`."""
        slot = self.arenas.get(nbytes)
        if slot is None:
            slot = self.arenas[nbytes] = ArenaSlot(self._alloc(nbytes, False))
        slot.users += 1
        return slot

    def release_arena(self, nbytes: int) -> bool:
        """A graph on the arena of `nbytes` is unloaded; the last one frees it (on CUDA the memory
        goes back to the device: elastic capacity). True if it was freed."""
        slot = self.arenas.get(nbytes)
        if slot is None:
            return False
        slot.users -= 1
        if slot.users > 0:
            return False
        del self.arenas[nbytes]
        if slot.buf.is_cuda:
            import torch

            del slot
            torch.cuda.ipc_collect()  # a block held for IPC peers that have released it since
            torch.cuda.empty_cache()  # torch's caching allocator would keep the block otherwise
        return True

    def acquire(self, v: Vertex) -> torch.Tensor:
        """The uint8 host bytes of sourced input `v`, read from its source on first use."""
        key = source_key(v)
        r = self._resident.get(key)
        if r is None:
            assert v.source is not None
            t = sources.read(v.source, v.shape, v.dtype, f"gpu:{self.gpu} input {v.id!r}")
            buf = flat = t.reshape(-1).view(torch.uint8)
            if self.pinned:
                buf = self._alloc(flat.numel(), True)
                buf.copy_(flat)
            self.bytes_read += flat.numel()
            r = self._resident[key] = _Resident(buf)
        r.users += 1
        return r.buf

    def release(self, v: Vertex) -> None:
        """A graph that acquired `v` is unloaded. The value stays for the worker's later graphs
        (a model's plans for another capacity, say) until `drop_unused` or the store goes."""
        r = self._resident.get(source_key(v))
        if r is not None:
            r.users -= 1

    def drop_unused(self) -> int:
        """Drops the resident inputs no loaded graph uses; returns the bytes freed."""
        unused = [k for k, r in self._resident.items() if r.users <= 0]
        freed = sum(self._resident[k].buf.numel() for k in unused)
        for k in unused:
            del self._resident[k]
        return freed

    def state(self, id: str, nbytes: int, dtype: str) -> State:
        """State `id`, made (zero) on first use; RunError if it exists with another size."""
        s = self.states.get(id)
        if s is None:
            s = self.states[id] = State(self._alloc(nbytes, True), self._gone.pop(id, -1) + 1)
            s.buf.zero_()
        elif s.buf.numel() != nbytes:
            raise RunError(
                f"gpu:{self.gpu}: state {id!r} holds {s.buf.numel()} bytes, a graph wants {nbytes} ({dtype})"
            )
        return s

    def write_state(self, id: str, value: torch.Tensor) -> None:
        """Sets state `id` to `value` (made if new; RunError if it exists with another size)."""
        flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
        s = self.state(id, flat.numel(), str(value.dtype).removeprefix("torch."))
        s.buf.copy_(flat)
        s.version += 1

    def read_state(self, id: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A copy of state `id` as a typed CPU tensor."""
        s = self.states.get(id)
        if s is None:
            raise RunError(f"gpu:{self.gpu}: no state {id!r}")
        return s.buf.to("cpu", copy=True).view(torch_dtype(dtype)).view(shape)

    def move_states(self, renames: dict[str, str], drop: list[str] | tuple[str, ...] = ()) -> dict:
        """Between runs: drops the states `drop` (their memory freed) and gives each state of
        `renames` (old id -> new id, all at once: a permutation is fine) its new id. Ids this
        worker does not hold are ignored (a model's ids name every GPU's states). A state taken
        over by a rename is dropped. No data is copied. Returns the counts."""
        dropped = 0
        for id in drop:
            dropped += self._drop(id)
        moving = {old: self.states.pop(old) for old in renames if old in self.states}
        for old, st in moving.items():
            self._gone[old] = max(self._gone.get(old, -1), st.version)
        for old, st in moving.items():
            new = renames[old]
            dropped += self._drop(new)
            # a version the arena cannot hold under `new`: above any it saw there
            st.version = max(st.version, self._gone.pop(new, -1)) + 1
            self.states[new] = st
        self.states_dropped += dropped
        return {"moved": len(moving), "dropped": dropped}

    def _drop(self, id: str) -> int:
        st = self.states.pop(id, None)
        if st is None:
            return 0
        self._gone[id] = max(self._gone.get(id, -1), st.version)
        st.buf = torch.empty(0, dtype=torch.uint8)  # a graph that still names it cannot keep its memory
        return 1

    def clear_states(self) -> None:
        """Forgets every state's contents (zeros, a new version); their memory stays."""
        for s in self.states.values():
            s.buf.zero_()
            s.version += 1

    def statistics(self) -> dict:
        return {
            "arenas": {n: len(a.holds) for n, a in self.arenas.items()},
            "resident_inputs": len(self._resident),
            "resident_bytes": sum(r.buf.numel() for r in self._resident.values()),
            "states": len(self.states),
            "states_dropped": self.states_dropped,
            "state_bytes": sum(s.buf.numel() for s in self.states.values()),
            "bytes_read_from_sources": self.bytes_read,
            "loads_skipped": self.loads_skipped,
            "streamed": self.reader.statistics(),
        }
