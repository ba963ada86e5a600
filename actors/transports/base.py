"""The transport contract: how a transfer vertex gets its source range from another worker's arena.

A transfer runs on its destination GPU once its source vertex (on the source GPU) has completed;
the MemGraph keeps the source range intact until the transfer completes, so the destination
simply pulls it. `Transport` lists every member the runtime may call (the executor, the worker's
Ray shell, the driver's link probes); a transport subclasses `TransportBase`, which gives the
optional ones their defaults, and implements `mode` and `pull` (the shape of Ray's
`experimental.channel` interfaces: one written contract, defaults for the rest).

Threads. "The loading thread" makes the executor and its transport (the worker actor's call
that loads a graph, or the local engine's caller); "a stream thread" is one of the backend's
threads that run a vertex's work or its `done` (`actors.backends.base`).

The built-in transports: `actors.transports.local` (workers of one process: a direct copy),
`actors.transports.objectstore` (through Ray's object store) and `actors.transports.cuda`
(CUDA IPC and P2P peer copies, NCCL through `actors.transports.nccl`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

import torch

from disco_ray.graph.errors import RunError
from disco_ray.graph.memgraph import Loc

from ..backends.base import Mode


class Transport(Protocol):
    """Every member of a transport the runtime uses (`TransportBase` gives the optional ones)."""

    def mode(self, src_gpu: int) -> Mode:
        """How a pull from `src_gpu` behaves: LAUNCH (it enqueues a copy, or copies, and returns),
        BLOCKING (it waits on the host for the bytes), DEFERRED (it registers the receive with a
        channel that enqueues it later, in an order agreed with the source: NCCL). Asked at each
        run's start, on the thread that starts it; picks the transfer's lane and mode."""
        ...

    def pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        """Copies the bytes of `loc` in worker `src_gpu`'s memory into the uint8 view `dst`; runs
        inside the transfer's `work`, on a stream thread, with its lane current.

        Args:
            src_gpu: the source worker.
            loc: the source range (arena, host store or spill file of `src_gpu`).
            dst: this worker's destination range.
            reader: the transfer vertex, and `expect` the vertex that wrote the range (-1:
                none): what the source's sanitizer checks the read against.

        Raises:
            RunError: naming the source, when it is lost or its sanitizer refused the read.
        """
        ...

    def attach(self, executor: Any) -> None:
        """Hands over this worker's executor (`actors.executor.Executor`) once both are made, on
        the loading thread, before any run."""
        ...

    def begin_run(self) -> None:
        """A run starts: called by the executor's `begin`, with its lock held."""
        ...

    def set_timeout(self, seconds: float | None) -> None:
        """The next run's timeout (`RunOptions.timeout`; None: none), from the worker's shell just
        before the run begins: a pull that waits on the host gives up once it has passed."""
        ...

    def watched(self) -> Collection[int]:
        """This worker's vertices whose completion the transport needs to hear of (`completed`):
        asked at each run's start (NCCL: the sources of its sends)."""
        ...

    def completed(self, vid: int) -> None:
        """Watched vertex `vid` completed; on the stream thread that ran its `done`, before the
        executor counts it."""
        ...

    def after_pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        """With the sanitizer on, once transfer `reader`'s pull has completed (same arguments as
        `pull`), on the stream thread that runs its `done`: check the bytes that arrived.

        Raises:
            RunError: the bytes differ from the source range.
        """
        ...

    def probe(self, src_gpu: int, nbytes: int) -> bool:
        """One copy of `nbytes` from `src_gpu` into this worker, waited for, outside any run:
        what the driver's link measurement times (`disco_ray.driver.cluster.measure_links`, in
        the worker actor's thread). False: this path has no one-sided copy, time the object
        store instead."""
        ...

    def describe(self) -> dict:
        """Peer setup, step 1 (`actors.transports.cuda.connect_workers`, after every worker
        loaded): what the driver needs to choose each pair's path."""
        ...

    def nccl_id(self) -> Any:
        """Peer setup, step 2, asked of one member: the id of a communicator to create."""
        ...

    def connect(
        self, infos: Sequence[dict], paths: dict[tuple[int, int], str], nccl_uid: Any = None
    ) -> dict[int, str]:
        """Peer setup, step 3, called on every worker at once: opens this worker's pairs (`infos`:
        every worker's `describe`; `paths`: each pair's chosen path). Returns {peer: path opened}."""
        ...

    def statistics(self) -> dict:
        """Counters for the worker's statistics (`{}`: none); from the shell's thread."""
        ...

    def close(self) -> None:
        """The graph is unloaded (its executor closed first); on the unloading thread."""
        ...


class TransportBase:
    """The optional members of `Transport`, with the defaults of a transport that needs no setup,
    no notice of runs or completions, and no check of its own."""

    def attach(self, executor: Any) -> None:
        pass

    def begin_run(self) -> None:
        pass

    def set_timeout(self, seconds: float | None) -> None:
        pass

    def watched(self) -> Collection[int]:
        return ()

    def completed(self, vid: int) -> None:
        pass

    def after_pull(self, src_gpu: int, loc: Loc, dst: torch.Tensor, reader: int, expect: int) -> None:
        pass  # the source's sanitizer checked the read itself

    def probe(self, src_gpu: int, nbytes: int) -> bool:
        return False

    def describe(self) -> dict:
        raise RunError(f"transport {type(self).__name__} connects no peers")

    def nccl_id(self) -> Any:
        raise RunError(f"transport {type(self).__name__} makes no NCCL communicator")

    def connect(
        self, infos: Sequence[dict], paths: dict[tuple[int, int], str], nccl_uid: Any = None
    ) -> dict[int, str]:
        raise RunError(f"transport {type(self).__name__} connects no peers")

    def statistics(self) -> dict:
        return {}

    def close(self) -> None:
        pass
