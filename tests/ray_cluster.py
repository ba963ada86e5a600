"""A throw-away multi-node Ray cluster on this machine, started with `ray start` (for multinode tests).

Every node gets its own free ports (other Ray sessions may run on the machine: nothing default is
used, not 6379 nor 8265) and all share one short temp dir (unix socket paths must stay short).
Every process the cluster starts inherits an environment variable holding a unique marker, so
`pids()` finds exactly this cluster's processes (raylets, GCS, agents, workers) and `stop()` ends
them by id: never `ray stop`, which would end every Ray session of the user on the machine.

Token authentication is off (RAY_AUTH_MODE=disabled) for every node, driver and CLI, as for
every Ray the suite starts: tests/conftest.py sets it before any `ray.init`, because Ray caches
the mode per process and a test driver may not mix modes. The GCS health check is made fast so
that a killed node is declared dead in about two seconds instead of fifteen.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK_VAR = "DISCO_RAY_TEST_CLUSTER"
FAST_HEALTH = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "4",
    # a loaded 2-core CI machine can take longer than the default to register a raylet
    "RAY_raylet_start_wait_time_s": "180",
}
OBJECT_STORE = "200000000"


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free right now (held open together so that they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _cmdline(pid: str) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


class LocalCluster:
    """A head node plus any number of extra nodes, all on this machine."""

    def __init__(self, *, checkout_on_path: bool = True) -> None:
        self.mark = uuid.uuid4().hex
        self.temp_dir = tempfile.mkdtemp(prefix="drc", dir="/tmp")
        self.port: int | None = None
        self.dashboard_port: int | None = None
        self.node_manager_ports: dict[str, int] = {}  # node name -> its raylet's port
        bindir = str(Path(sys.executable).parent)
        self.env = {
            **os.environ,
            **FAST_HEALTH,
            MARK_VAR: self.mark,
            "RAY_AUTH_MODE": "disabled",  # as for every Ray of the suite (tests/conftest.py)
            "RAY_USAGE_STATS_ENABLED": "0",
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        }
        self.env.pop("RAY_ADDRESS", None)
        self.env.pop("PYTHONPATH", None)
        if checkout_on_path:  # workers import this checkout's packages (not installed in the venv)
            self.env["PYTHONPATH"] = str(ROOT)
        self.ray = str(Path(bindir) / "ray")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, args: list[str]) -> None:
        r = subprocess.run(
            [self.ray, "start", *args], env=self.env, capture_output=True, text=True, timeout=180
        )
        if r.returncode != 0:
            raise RuntimeError(
                f"ray start {' '.join(args[:2])} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
            )

    def _node_args(self, name: str, num_cpus: int, num_gpus: int, ports: list[int]) -> list[str]:
        self.node_manager_ports[name] = ports[0]
        return [
            f"--num-cpus={num_cpus}",
            f"--num-gpus={num_gpus}",
            f'--resources={{"{name}": 10}}',
            f"--temp-dir={self.temp_dir}",
            f"--object-store-memory={OBJECT_STORE}",
            f"--node-manager-port={ports[0]}",
            f"--object-manager-port={ports[1]}",
            f"--dashboard-agent-listen-port={ports[2]}",
            f"--dashboard-agent-grpc-port={ports[3]}",
            f"--runtime-env-agent-port={ports[4]}",
            f"--metrics-export-port={ports[5]}",
            "--disable-usage-stats",
        ]

    def start_head(
        self, name: str = "node_a", *, num_cpus: int = 2, num_gpus: int = 2, dashboard: bool = False
    ):
        for attempt in range(2):  # a port taken between free_ports and ray start: once more, new ports
            ports = free_ports(9)
            self.port, self.dashboard_port = ports[6], ports[7]
            try:
                self._start(
                    [
                        "--head",
                        f"--port={self.port}",
                        f"--include-dashboard={'true' if dashboard else 'false'}",
                        "--dashboard-host=127.0.0.1",
                        f"--dashboard-port={self.dashboard_port}",
                        f"--ray-client-server-port={ports[8]}",
                        *self._node_args(name, num_cpus, num_gpus, ports),
                    ]
                )
                break
            except RuntimeError:
                self._kill_all()
                if attempt:
                    raise
        return self

    def add_node(self, name: str, *, num_cpus: int = 2, num_gpus: int = 2):
        ports = free_ports(6)
        self._start([f"--address={self.address}", *self._node_args(name, num_cpus, num_gpus, ports)])
        return self

    def raylet_pid(self, name: str) -> int:
        """The raylet process of node `name` (found by its node-manager port)."""
        flag = f"--node_manager_port={self.node_manager_ports[name]}"
        for pid in self.pids():
            try:
                argv = _cmdline(str(pid))
            except OSError:
                continue
            if argv and argv[0].endswith("raylet") and flag in argv:
                return pid
        raise LookupError(f"no raylet of node {name} ({flag})")

    def kill_node(self, name: str) -> None:
        """Kills node `name`'s raylet and every process under it at once, as when a machine is
        lost (a raylet killed alone leaves its workers running until they notice)."""
        raylet = self.raylet_pid(name)
        for pid in [*_descendants(raylet), raylet]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def pids(self) -> list[int]:
        """Live processes of this cluster (their environment holds its marker); zombies excluded."""
        needle = f"{MARK_VAR}={self.mark}".encode()
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{d}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
            except OSError:
                continue
            out.append(int(d))
        return out

    def _kill_all(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def stop(self, grace_s: float = 3.0) -> list[int]:
        """Ends every process of the cluster (SIGTERM, then SIGKILL); returns any still alive after."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for pid in self.pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            t_end = time.monotonic() + wait
            while self.pids() and time.monotonic() < t_end:
                time.sleep(0.1)
        left = self.pids()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out
