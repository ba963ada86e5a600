"""Noticing that a Ray run cannot finish: a silent actor (heartbeats, `Watchdog`) and a lost
cluster (`GcsMonitor`), each named in one line instead of a hang or Ray's minute of retries.

The engine (`disco_ray.driver.engine_ray`) drives both from its wait loop; they know nothing of
graphs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("disco_ray")
HEARTBEAT_S = 1.0  # how often the driver pings every actor of a running graph (and tries the GCS)


class Watchdog:
    """Heartbeats through Ray: pings each actor every `every` s, and says which one (its key) has
    a ping out and has not answered any for more than `stall` s (counted from its last answer, so
    a process stopped just after one is named `stall` s later, not a heartbeat more). An actor
    answers pings on a thread of its own (threaded actors) while its streams compute, so only a
    stopped or hung process goes quiet."""

    def __init__(self, actors: Mapping[int, object], every: float, stall: float):
        self.actors, self.every, self.stall = dict(actors), every, stall
        self.out: dict[int, object] = {}  # key -> its unanswered ping
        now = time.monotonic()
        self.seen = dict.fromkeys(self.actors, now)  # key -> when its last answer came (or the start)
        self.next = now + every  # a run shorter than a heartbeat sends no ping

    def check(self) -> tuple[int, float] | None:
        """(key, seconds quiet) of an actor silent too long, else None; sends the next pings."""
        import ray

        now = time.monotonic()
        if self.out:
            refs = list(self.out.values())
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
            for key, ref in list(self.out.items()):
                if ref in ready:  # answered (or died: the run's serve refs tell that)
                    del self.out[key]
                    self.seen[key] = now
                elif now - self.seen[key] > self.stall:
                    return key, now - self.seen[key]
        if now >= self.next:
            for key, actor in self.actors.items():
                if key not in self.out:
                    self.out[key] = actor.ping.remote()  # type: ignore[attr-defined]
            self.next = now + self.every
        return None


def watched_get(refs: list, dog: Watchdog, name: Callable[[int], str], when: str) -> list:
    """ray.get(refs) while `dog` pings its actors: RunError naming (`name(key)`) one that stays
    silent, `when` saying what it was doing (loading a graph, moving states); never a hang."""
    import ray

    from disco_ray.graph.errors import RunError

    while True:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.2)
        if len(ready) == len(refs):
            return ray.get(refs)
        silent = dog.check()
        if silent is not None:
            raise RunError(
                f"{name(silent[0])} has not answered for {silent[1]:.0f} s (stopped or hung) {when}"
            )


GCS_LOST_EXITS = False  # the CLI sets it: a lost GCS ends the process with one line (see GcsMonitor)


class GcsMonitor:
    """A thread that tries the GCS port once a HEARTBEAT_S during a run. Once the GCS is gone the
    driver's Ray blocks in its next call and, after a minute of retries, exits with Ray's message
    only; so the monitor acts from its own thread: in the CLI (`GCS_LOST_EXITS`) it prints the
    one error line, kills the processes of a private Ray (all the driver's descendants: raylet,
    agents, actors) and exits with status 2; in a library it interrupts the main thread."""

    def __init__(self, address: str | None, private: bool):
        self.address, self.private = address, private
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="gcs-monitor")

    def __enter__(self) -> GcsMonitor:
        return self

    def due(self) -> None:
        """The run is still going after a poll interval: the thread starts now (once). Its first
        try comes a HEARTBEAT_S later anyway, so a short run (a decode step) never pays for a
        thread's start."""
        if self.address and not self.thread.is_alive() and not self.stop.is_set():
            self.thread.start()

    def __exit__(self, *exc) -> None:
        self.stop.set()

    def _watch(self) -> None:
        host, _, port = (self.address or "").rpartition(":")
        misses = 0
        while not self.stop.wait(HEARTBEAT_S):
            try:
                with socket.create_connection((host, int(port)), timeout=2.0):
                    misses = 0
                    continue
            except (OSError, ValueError) as e:
                misses += 1
                why = (e.strerror if isinstance(e, OSError) else None) or type(e).__name__
            if misses >= 2 and not self.stop.is_set():  # twice: not one dropped connection
                self._lost(f"the Ray cluster's GCS at {self.address} is gone ({why}): the run is abandoned")
                return

    def _lost(self, msg: str) -> None:
        log.debug(msg)
        if not GCS_LOST_EXITS:
            import _thread

            _thread.interrupt_main()  # KeyboardInterrupt where the main thread next runs Python
            return
        print(f"disco-ray: error: {msg}", file=sys.stderr, flush=True)
        if self.private:
            kill_descendants(os.getpid())
        os._exit(2)


def kill_descendants(pid: int) -> None:
    """SIGKILL to every process below `pid` (a private Ray: raylet, agents, workers), from /proc."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    todo, seen = list(children.get(pid, [])), set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo += children.get(p, [])
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def gcs_address() -> str | None:
    """HOST:PORT of the connected cluster's GCS (None where Ray does not say)."""
    import ray

    try:
        if ray.util.client.ray.is_connected():  # Ray Client: the GCS is the server's to reach, not ours
            return None
        return ray.get_runtime_context().gcs_address
    except Exception:  # an older or newer Ray without it: no GCS check
        return None
