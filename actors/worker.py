"""GpuWorker: the Ray actor shell of one GPU; all logic is in `actors.executor.Executor`.

A threaded actor (`max_concurrency` > 1): `serve` blocks one thread for the whole run (its
ObjectRef is how the driver notices the actor dying), while `dispatch` (from the coordinator)
and `read_range` (peers pulling transfer sources) run in the others.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc, MemGraph
from disco_ray.graph.taskgraph import TaskGraph

from .executor import Executor, WorkerConfig
from .transport import RayTransport


class GpuWorker:
    """One per GPU; `load` a graph (allocating its arena), run it any number of times, load the next."""

    def __init__(self, op_modules: Sequence[str] = (), torch_threads: int | None = 1):
        for m in op_modules:
            importlib.import_module(m)
        if torch_threads:
            torch.set_num_threads(torch_threads)  # S streams x N workers share the host's cores
        self.ex: Executor | None = None
        self.coord: Any = None
        self.transport: Any = None

    def ping(self) -> bool:
        return True

    def load(
        self,
        gpu: int,
        mg: MemGraph,
        tg: TaskGraph,
        coordinator: Any,
        workers: Sequence[Any],
        config: WorkerConfig,
    ) -> dict:
        """Drops the previous graph and allocates the arena and host store of `mg` for GPU `gpu`."""
        self.unload()
        self.coord = coordinator
        if config.backend == "cuda":  # IPC / NCCL peers, opened by `transport_connect` once all have loaded
            from .transport_cuda import CudaTransport

            self.transport = CudaTransport(gpu, workers)
        else:
            self.transport = RayTransport(workers)
        self.ex = Executor(
            gpu,
            mg,
            tg,
            config,
            transport=self.transport,
            report=self._report,
            fail=self._fail,
        )
        if hasattr(self.transport, "attach"):
            self.transport.attach(self.ex)
        return self.ex.statistics()

    def transport_describe(self, nccl_ids_for: list[int]) -> dict:
        return self.transport.describe(nccl_ids_for)

    def transport_connect(self, infos: list[dict], paths: dict) -> dict:
        return self.transport.connect(infos, paths)

    def nccl_send(self, dst_gpu: int, loc: Loc) -> None:
        self.transport.send(dst_gpu, loc)

    def unload(self) -> None:
        if self.ex is not None:
            self.ex.close()
            self.ex = None
        if hasattr(self.transport, "close"):
            self.transport.close()

    def _report(self, gpu: int, vids: list[int]) -> None:
        self.coord.report.remote(gpu, vids)  # fire and forget: the coordinator orders nothing by it

    def _fail(self, gpu: int, vid: int | None, message: str) -> None:
        self.coord.fail.remote(gpu, vid, message)

    def begin(self, inputs: Mapping[str, torch.Tensor], check: bool, delay, seed: int) -> None:
        self._ex().begin(inputs, check=check, delay=delay, seed=seed)

    @ray.method(num_returns=0)  # fire and forget: no return object to make
    def dispatch(self, vids: list[int]) -> None:
        self._ex().dispatch(vids)

    def serve(self) -> str | None:
        """Blocks until this GPU's vertices are all done (None) or the run failed (the message)."""
        ex = self._ex()
        ex.wait()
        return ex.error

    def read_range(self, loc: Loc, reader: int, expect: int):
        return self._ex().read_range(loc, reader, expect)

    def outputs(self, wanted: list[tuple[str, int]]) -> dict[str, Any]:
        """Raw bytes (numpy uint8) of each wanted output: cheaper to ship than tensors."""
        return {value: self._ex().output_bytes(vid) for value, vid in wanted}

    def trace(self) -> list[tuple[int, int, int, int]]:
        return self._ex().trace

    def statistics(self) -> dict:
        out = self._ex().statistics()
        if hasattr(self.transport, "statistics"):
            out["transport"] = self.transport.statistics()
        return out

    def call(self, fn, *args):
        """Runs `fn(self, *args)` in this actor (link probes and diagnostics: disco_ray/driver/cluster.py)."""
        return fn(self, *args)

    def _ex(self) -> Executor:
        if self.ex is None:
            raise RunError("this worker has no graph loaded")
        return self.ex
