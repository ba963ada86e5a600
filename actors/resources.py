"""What an Executor allocates once per plan, before any run: the arena (the worker store's) and
the host store with a torch view per vertex operand, each vertex's plan, the input loads and the
states its carried values are saved to, the spill file and its read-ahead when the plan uses the
disk, the lanes and stream slots, and the kernel workspace (`actors.executor`: what a run does
with them; TURNIP section 5: no allocation while a graph runs); and reading those ranges back
(`read_range`, checked by a run's sanitizer when it has one).
"""

from __future__ import annotations

import numpy as np
import torch

from disco_ray.graph.kernels import temp_bytes
from disco_ray.graph.memgraph import DISK, HOST, Loc, MemGraph, MemVertex
from disco_ray.graph.taskgraph import TaskGraph

from .backends import make_backend
from .backends.base import Backend, Mode
from .lanes import Lanes
from .loads import Loads
from .options import DEFAULT_WORKER, WorkerConfig
from .plans import PlanKind, VertexPlan, Views, as_tensor, describe
from .sanitizer import Sanitizer, granule_for
from .slots import StreamSlots
from .tiers.base import ReloadAhead, SpillTier
from .tiers.spill import ReadAhead, SpillFile
from .tiers.store import WorkerStore
from .transports.base import Transport
from .worker_core import WorkerCore


class GpuResources:
    """The arena, host store, views, plans, loads, disk tier and lanes of GPU `gpu` of `mg`."""

    def __init__(
        self,
        gpu: int,
        mg: MemGraph,
        tg: TaskGraph,
        config: WorkerConfig = DEFAULT_WORKER,
        *,
        backend: Backend | None = None,
        store: WorkerStore | None = None,
    ):
        """`backend`: an instance to use instead of making `config.backend`'s. `store`: the worker's
        arena, resident inputs and states, shared with its other graphs (default: a store of its own)."""
        self.gpu, self.mg, self.tg = gpu, mg, tg
        self.backend = make_backend(config.backend) if backend is None else backend
        if store is None:
            store = WorkerStore(gpu, self.backend.alloc, self.backend.stages_inputs)
        self.store = store
        self.streams = config.streams
        # None: the backend's default (cuda 4; cpu 0, where a stream thread runs its work itself)
        self.ahead = self.backend.default_ahead if config.ahead is None else config.ahead
        self.core = WorkerCore(mg, gpu, self.streams)
        mine = [mg.vertex(v) for v in self.core.mine]
        self._make_views(mine)
        self._make_loads(config)
        self._make_disk_tier(mine, config)
        self._make_lanes()
        self._sanitizer: Sanitizer | None = None  # a run's, when it checks (`Executor.begin`)
        self._check = False

    def _make_views(self, mine: list[MemVertex]) -> None:
        """The arena (the store's, for this capacity), the host store, and each vertex's plan."""
        mg, gpu = self.mg, self.gpu
        host_need = max(
            [v.out.end for v in mine if v.out.device == HOST]
            + [r.loc.end for v in mine for r in v.ins if r.loc.device == HOST]
            + [0]
        )
        declared = mg.host_capacity[gpu] if gpu < len(mg.host_capacity) else 0
        self.arena_slot = self.store.arena(mg.capacity[gpu])
        self.arena = self.arena_slot.buf
        self.host = self.backend.alloc(max(declared, host_need), host=True)
        self.granule = granule_for([v.out for v in mine] + [r.loc for v in mine for r in v.ins])
        self.views = Views(gpu, mg, self.tg, self.arena, self.host)
        self.plans: dict[int, VertexPlan] = {v.id: self.views.plan(v) for v in mine}

    def _make_loads(self, config: WorkerConfig) -> None:
        """What the input loads read, and the states the carried values of this GPU are saved to."""
        mg, tg, store = self.mg, self.tg, self.store
        self.loads = Loads(
            mg,
            tg,
            self.plans,
            store,
            self.backend.alloc,
            self.backend.stages_inputs,
            config.sources == "disk",
        )
        self.input_values = self.loads.caller  # what the caller hands in
        self.staging = self.loads.staging
        try:  # carried values of this GPU: (value, the vertex holding it at the end, its state)
            self.carries = [
                (value, mg.outputs[value], store.state(key, tg[value].nbytes, tg[value].dtype))
                for value, key in tg.carry.items()
                if tg[value].gpu == self.gpu
            ]
            self._carry_keys = [tg.carry[value] for value, _, _ in self.carries]
        except BaseException:
            self.loads.release()
            raise

    def _make_disk_tier(self, mine: list[MemVertex], config: WorkerConfig) -> None:
        """The spill file and its read-ahead, when the plan of this GPU uses the disk."""
        disk_locs = [v.out for v in mine if v.out.device == DISK]
        disk_locs += [r.loc for v in mine for r in v.ins if r.loc.device == DISK]
        self.spill: SpillTier | None = None
        self.read_ahead: ReloadAhead | None = None
        if not disk_locs:
            return
        mg, gpu = self.mg, self.gpu
        disk_need = max(loc.end for loc in disk_locs)
        declared = mg.disk_capacity[gpu] if gpu < len(mg.disk_capacity) else 0
        largest = max(loc.nbytes for loc in disk_locs)
        spill = SpillFile(config.disk_dir, gpu, max(declared, disk_need), largest, self.backend.alloc)
        self.spill = spill
        # reloads from disk, read ahead in the plan's order once their offload has run
        items = [
            (vid, p.src_vid, p.src_loc.offset, p.src_loc.nbytes)
            for vid, p in sorted(self.plans.items())
            if p.kind is PlanKind.UNSPILL and p.src_loc is not None
        ]
        self.read_ahead = ReadAhead(spill, items, self.backend.alloc)

    def _make_lanes(self) -> None:
        """The lanes after the compute streams (the lane rule: actors/lanes.py) and the kernel workspace."""
        self.lanes = lanes = Lanes.of(self.mg, self.gpu, self.streams)
        self.peers = list(lanes.peers)
        self.h2d, self.d2h, self.peer_lane = lanes.h2d, lanes.d2h, lanes.peer
        self.deferred_lane, self.disk_w, self.disk_r = lanes.deferred, lanes.disk_w, lanes.disk_r
        self.slots = StreamSlots(self.core, self.streams, lanes.limits)
        self._lane_tables: dict[tuple[Mode, ...], tuple[dict[int, int], dict[int, Mode]]] = {}
        # kernel temporaries: the most any kernel of this GPU needs, kept ready per compute stream
        self.workspace = max(
            [
                temp_bytes(p.op, p.out, p.ins, p.attrs)
                for p in self.plans.values()
                if p.kind is PlanKind.KERNEL
            ]
            + [0]
        )

    def read_range(self, loc: Loc, reader: int, expect: int, into: torch.Tensor | None = None):
        """Bytes of `loc` (this GPU's arena, host store or spill file), checked by the sanitizer
        when it is on.

        Copies into `into` when given; otherwise returns a fresh numpy copy (what a Ray call
        ships; the only allocation during a run, on the cpu transport).
        """
        src = self._range(loc, reader)
        san = self._sanitizer if self._check else None
        value = self.mg.vertex(expect).value if expect >= 0 else "?"
        if san is not None and expect >= 0:
            san.check_read(reader, value, loc, expect, "before it ran")
        if into is not None:
            into.copy_(src)
            out = None
        else:
            out = src.to("cpu", copy=True).numpy()
        if san is not None and expect >= 0:
            san.check_read(reader, value, loc, expect, "after it ran")
        return out

    def output_bytes(self, vid: int) -> np.ndarray:
        """A copy of the bytes of the output held by vertex `vid` of this GPU (checked if `check`)."""
        return self.read_range(self.mg.vertex(vid).out, vid, vid)

    def output(self, value: str, vid: int) -> torch.Tensor:
        """A copy of output `value`, held by vertex `vid` of this GPU, as a typed CPU tensor."""
        return as_tensor(self.output_bytes(vid), self.tg[value])

    def _range(self, loc: Loc, vid: int) -> torch.Tensor:
        """The bytes of `loc`: a view of the arena or host store, a copy of a spill-file range."""
        if loc.device == DISK and self.spill is not None:  # a kept value the plan left on disk
            out = torch.empty(loc.nbytes, dtype=torch.uint8)
            self.spill.read(loc.offset, out, lambda d, s: d.copy_(s))
            return out
        return self.views.buf(loc, vid)

    def _lanes(self, tr: Transport | None) -> tuple[dict[int, int], dict[int, Mode]]:
        """(the lane of each copy and transfer, the mode of each vertex whose work is not LAUNCH),
        with transport `tr` (None: no peers)."""
        mode_of = (lambda src: Mode.BLOCKING) if tr is None else tr.mode
        # a table per plan, kept: it only changes with the transport's mode of each peer
        key = tuple(mode_of(p) for p in self.peers)
        got = self._lane_tables.get(key)
        if got is None:
            lane_of, mode = self.lanes.assign((self.mg.vertex(v) for v in self.plans), mode_of)
            for vid in self._streamed_loads():  # a file read waits on the host: beside the launch loop
                mode[vid] = Mode.BLOCKING
            got = self._lane_tables[key] = (lane_of, mode)
        return got

    def _streamed_loads(self) -> list[int]:
        """The loads that read their input from its file (`WorkerConfig.sources == "disk"`): on a
        backend that launches asynchronously they run aside (BLOCKING), as spill reloads do, so
        the read and its wait for the copy never hold the one launch loop (cuda)."""
        streams = self.loads.streams
        if streams is None or not self.backend.async_launch:
            return []
        kinds = (PlanKind.INPUT, PlanKind.RELOAD_INPUT)
        return [vid for vid, p in self.plans.items() if p.kind in kinds and p.value in streams]

    def held(self) -> dict:
        """What this GPU holds: its arena, host store, streams, lanes, disk tier and backend."""
        return {
            "gpu": self.gpu,
            "vertices": len(self.plans),
            "streams": self.streams,
            "lanes": self.slots.total - self.streams,
            "workspace_bytes": self.workspace,
            "arena_bytes": self.arena.numel(),
            "host_bytes": self.host.numel(),
            "granule": self.granule,
            "store": self.store.statistics(),
            **(
                {"disk": {**self.spill.statistics(), "read_ahead": self._read_ahead().statistics()}}
                if self.spill is not None
                else {}
            ),
            **({"backend": backend} if (backend := self.backend.statistics()) else {}),
        }

    def _new_sanitizer(self) -> Sanitizer:
        """A checker of this GPU's arena, host store and spill file (`check=True` runs)."""
        return Sanitizer(
            self.gpu,
            self.arena.numel(),
            self.host.numel(),
            self.granule,
            lambda vid: describe(self.mg, vid),
            self._acc_alias(),
            self.spill.nbytes if self.spill is not None else 0,
        )

    def _acc_alias(self) -> dict[int, int]:
        """Sum-into member -> its group's last member (the writer its readers name)."""
        last: dict[str, int] = {}
        for vid, key in self.core.groups.items():
            last[key] = max(last.get(key, vid), vid)
        return {vid: last[key] for vid, key in self.core.groups.items()}

    def _spill(self) -> SpillTier:
        assert self.spill is not None  # a plan with disk vertices made one
        return self.spill

    def _read_ahead(self) -> ReloadAhead:
        assert self.read_ahead is not None  # made with the spill tier
        return self.read_ahead
