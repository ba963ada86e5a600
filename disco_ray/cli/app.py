"""The `disco-ray` command line: the parser, the entry point and the argument types every command shares.

Every subcommand NAME is a pair `add_NAME(subparsers)` (adds the parser NAME and its arguments;
written as `@command(NAME, help=..., description=...) def add_NAME(p)`, which fills the parser)
and `cmd_NAME(args) -> int` (runs it, returns the exit status), in the module that COMMANDS names
for it; adding a command is one line in COMMANDS. A module listed there keeps heavy imports (ray, torch) inside `cmd_NAME`, so that
`disco-ray plan` stays quick.

Exit status: 0 success, 1 `verify` found violations (or `run --check-reference`, `bench` a
mismatch), 2 bad usage or bad input, 141 stdout's reader closed early (`disco-ray ops | head`: no
message). Input errors (every DiscoError, unreadable or unwritable
files) print exactly one line, `disco-ray: error: ...`, and never leave a partial output file.
What a command reports on the way goes through `logging` (logger "disco_ray", to stderr):
INFO by default, `-q` warnings only, `-v` debug too; results go to stdout or files.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from disco_ray.graph import formats
from disco_ray.graph.errors import DiscoError, UsageError
from disco_ray.graph.sizes import format_size, parse_capacity, parse_size

from .paths import check_writable, file_problem, writable_file  # noqa: F401  (commands import them from here)

PROG = "disco-ray"
# subcommand -> module defining add_<name> and cmd_<name>, in --help order
COMMANDS: dict[str, str] = {
    "plan": "disco_ray.cli.plan",
    "verify": "disco_ray.cli.plan",
    "info": "disco_ray.cli.plan",
    "ops": "disco_ray.cli.plan",
    "run": "disco_ray.cli.run",
    "workload": "disco_ray.cli.workload",
    "bench": "disco_ray.cli.bench",
    "plot": "disco_ray.cli.plot",
    "generate": "disco_ray.cli.generate",
    "finetune": "disco_ray.cli.finetune",
    "quantize": "disco_ray.cli.quantize",
    "demo": "disco_ray.cli.demo",
}


class _Parser(argparse.ArgumentParser):
    """Reports usage errors as the one line every other error uses (argparse prints two)."""

    def error(self, message: str):
        where = self.prog.removeprefix(PROG).strip()
        raise UsageError(f"{where}: {message}" if where else message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="Plan and run ML workloads larger than GPU memory (TURNIP/DISCO)."
    )
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")
    loud.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        getattr(importlib.import_module(module), f"add_{name}")(sub)
    return parser


def command(name: str, help: str, description: str | None = None):
    """Makes `add_NAME(p)`, which adds a command's arguments to its parser, the `add_NAME(sub)`
    that COMMANDS calls: it makes the parser NAME with this help and description, then fills it."""

    def make(add_args):
        @functools.wraps(add_args)
        def add(sub) -> None:
            add_args(sub.add_parser(name, help=help, description=description))

        return add

    return make


_SIGTERM: list[bool] = []  # set when SIGTERM came: the KeyboardInterrupt it raised means "terminated"


def _on_sigterm(signum, frame) -> None:
    """SIGTERM, raised in the main thread as Ctrl-C is: a KeyboardInterrupt (the only exception
    Ray's blocking calls let through), so the same clean-up runs (Programs close their actors, a
    private Ray is shut down); the flag tells main which one line to print."""
    _SIGTERM.append(True)
    raise KeyboardInterrupt


_CLOSE_LATER: list[Callable[[], object]] = []  # exits put off until the error line is out


@contextlib.contextmanager
def closing_after_error(resource):
    """`with resource:`, except that when the body raises a DiscoError the resource's exit (its
    actors killed, a private Ray shut down: seconds) runs after `main` has printed the error
    line, so that a stopped worker is named as soon as the driver finds it."""
    with contextlib.ExitStack() as stack:
        got = stack.enter_context(resource)
        try:
            yield got
        except DiscoError:
            _CLOSE_LATER.append(stack.pop_all().close)
            raise


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; returns its exit status (the console script's entry point)."""
    main_thread = threading.current_thread() is threading.main_thread()
    _SIGTERM.clear()
    before = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None  # kept across ray.init
    try:
        return _main(argv)
    finally:
        while _CLOSE_LATER:  # after the error line (`closing_after_error`)
            with contextlib.suppress(Exception):  # the run has failed already: its error is the one
                _CLOSE_LATER.pop()()
        if main_thread:
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        setup_logging(logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO)
        cmd = getattr(importlib.import_module(COMMANDS[args.command]), f"cmd_{args.command}")
        status = int(cmd(args))
        sys.stdout.flush()  # a reader that closed early shows here, not at the interpreter's exit
        return status
    except BrokenPipeError:  # `disco-ray ops | head`: the reader has all it wanted
        _quiet_stdout()
        return 141
    except DiscoError as e:
        _error(str(e))
    except OSError as e:  # an unwritable output directory, a full disk: the user's to fix
        _error(f"{e.filename}: {e.strerror}" if e.filename else str(e))
    except KeyboardInterrupt:
        if _SIGTERM:
            _error("terminated (SIGTERM): the run was stopped and its workers shut down")
            return 143
        _error("interrupted (Ctrl-C): the run was stopped and its workers shut down")
        return 130
    except RecursionError:  # a structure too deep for any reader: the input's, not ours
        _error("input nested too deeply to be read")
    return 2


def _quiet_stdout() -> None:
    """Points stdout at /dev/null, so that the interpreter's last flush of what is still buffered
    raises no BrokenPipeError at exit (Python's "Note on SIGPIPE")."""
    with contextlib.suppress(OSError, ValueError):  # stdout already closed or no real file
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _error(msg: str) -> None:
    print(f"{PROG}: error: {'; '.join(msg.splitlines())}", file=sys.stderr)


class _Stderr(logging.Handler):
    """Plain lines on whatever sys.stderr is when a message comes (warnings prefixed)."""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        print(f"warning: {msg}" if record.levelno >= logging.WARNING else msg, file=sys.stderr)


def setup_logging(level: int) -> None:
    """Messages of the "disco_ray" loggers to stderr, from `level` up."""
    log = logging.getLogger("disco_ray")
    log.setLevel(level)
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        log.addHandler(_Stderr())
        log.propagate = False


# ---- argument types ----------------------------------------------------------------------------
def size_arg(text: str) -> int:
    """argparse type for a byte size ("64MiB")."""
    try:
        return parse_size(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def gpu_size_arg(text: str) -> tuple[int, int]:
    """argparse type for `G=SIZE`, one GPU's capacity."""
    g, eq, size = text.partition("=")
    if not eq or not g.strip().isdigit():
        raise argparse.ArgumentTypeError(f"bad GPU capacity {text!r} (want G=SIZE, e.g. 1=32MiB)")
    return int(g), size_arg(size)


def power_of_two(text: str) -> int:
    n = positive_int(text)
    if n & (n - 1) or n > 1 << 30:
        raise argparse.ArgumentTypeError(f"want a power of two up to 2**30, got {text[:40]!r}")
    return n


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"want a positive integer, got {text!r}")
    return n


def bounded_int(lo: int, hi: int):
    """argparse type for an integer in lo..hi."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"want an integer, got {text[:40]!r}") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"want an integer in {lo}..{hi}, got {text[:40]}")
        return n

    return parse


SEED_MAX = 2**63 - 1  # torch's generators take a 64-bit seed
seed_arg = bounded_int(0, SEED_MAX)


def seconds_arg(text: str) -> float:
    """argparse type for a time limit: a finite number of seconds > 0."""
    try:
        s = float(text)
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and s > 0):
        raise argparse.ArgumentTypeError(f"want a number of seconds > 0, got {text[:40]!r}")
    return s


def output_path(text: str) -> Path:
    """argparse type for a graph file to write: checks its suffix and that it can be written."""
    path = Path(text)
    if path.suffix.lower() not in formats.SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"{text}: unknown file suffix {path.suffix or '(none)'!r} (use .json or .msgpack)"
        )
    problem = file_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return path


def capacity_arg(text: str) -> int | list[int] | str:
    """argparse type for `SIZE` (every GPU), `SIZE,SIZE,...` (one per GPU), or `auto` / `P%`
    (of each GPU's free memory, kept as the string: `disco_ray.driver.free_memory`)."""
    from disco_ray.driver.free_memory import relative

    try:
        return relative(text) or parse_capacity(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_capacity_args(
    p: argparse.ArgumentParser, required: bool = False, default: str = "", group=None, measured: bool = True
) -> None:
    """`--capacity SIZE[,SIZE...]` and `--capacity-gpu G=SIZE`: one syntax on every command.
    `group`: a required mutually exclusive group that `--capacity` joins (one of it is needed).
    `measured`: the command runs here, so `auto` / `P%` of the devices' free memory apply."""
    share = ", or of each GPU's free memory: auto (the most that fits, less a margin) or a share (60%%)"
    (group or p).add_argument(
        "--capacity",
        type=capacity_arg,
        required=required,
        metavar="SIZE[,SIZE...]",
        help="arena bytes of every GPU (e.g. 64MiB, 1.5GiB, 2GB), or one per GPU (64MiB,32MiB)"
        + (share if measured else "")
        + (f" (default: {default})" if default else ""),
    )
    p.add_argument(
        "--capacity-gpu",
        type=gpu_size_arg,
        action="append",
        metavar="G=SIZE",
        help="the capacity of GPU G (repeatable; overrides --capacity for that GPU)",
    )


def capacity_of(args: argparse.Namespace, gpus: int, measured: bool = True) -> int | list[int] | str | None:
    """The planner's capacity from `add_capacity_args`' options: one size, a list per GPU, "auto"
    or "P%" (where the command runs on this machine's devices: `measured`), or None (not given:
    the command's default)."""
    cap = args.capacity
    if isinstance(cap, str):
        if not measured:
            what = getattr(args, "command", "this command")
            raise UsageError(
                f"--capacity {cap}: {what} makes no run, so there is no device to measure; give a size"
            )
        if args.capacity_gpu:
            raise UsageError(f"--capacity-gpu overrides a size, not --capacity {cap}: give sizes")
        return cap
    if isinstance(cap, list) and len(cap) != gpus:
        raise UsageError(f"--capacity gives {len(cap)} sizes for {gpus} GPU(s)")
    if not args.capacity_gpu:
        return cap
    if cap is None:
        raise UsageError("--capacity-gpu overrides --capacity: give --capacity too")
    return capacities(gpus, cap, args.capacity_gpu)


def capacities(
    gpus: int, capacity: int | list[int], per_gpu: list[tuple[int, int]] | None
) -> int | list[int]:
    """The planner's capacity argument: one size for all GPUs, or a list once a GPU is overridden."""
    if not per_gpu:
        return capacity
    caps = list(capacity) if isinstance(capacity, list) else [capacity] * gpus
    for g, size in per_gpu:
        if g >= gpus:
            raise UsageError(
                f"--capacity-gpu {g}={format_size(size)}: gpu {g} out of range "
                f"0..{gpus - 1} (the graph has {gpus} GPU(s))"
            )
        caps[g] = size
    return caps


def disk_dir_arg(text: str) -> str:
    """argparse type for `--disk DIR`: a directory, or a path one can be made at."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a directory")
    base = path.absolute()
    while not base.exists():  # the directory that would hold it, made when a plan spills
        base = base.parent
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {base} is not a writable directory")
    return str(path)


def add_tier_args(p: argparse.ArgumentParser, disk: bool = True) -> None:
    """`--host-capacity SIZE[,SIZE...]` (the host store's budget per GPU, beyond which offloads go
    to disk) and, on commands that run, `--disk DIR` (where the spill files go)."""
    p.add_argument(
        "--host-capacity",
        type=capacity_arg,
        metavar="SIZE[,SIZE...]",
        help="host-store bytes of every GPU's worker, or one per GPU; offloads beyond it go to "
        "disk (default: unbounded)",
    )
    if disk:
        p.add_argument(
            "--disk",
            type=disk_dir_arg,
            metavar="DIR",
            help="directory of the workers' spill files (default: a temporary one, removed at the end)",
        )


def host_capacity_of(args: argparse.Namespace, gpus: int) -> int | list[int] | None:
    """The planner's host_capacity from `--host-capacity` (None: unbounded)."""
    cap = getattr(args, "host_capacity", None)
    if isinstance(cap, list) and len(cap) != gpus:
        raise UsageError(f"--host-capacity gives {len(cap)} sizes for {gpus} GPU(s)")
    return cap


def read_order(path: str) -> list[str]:
    """A vertex order: a JSON list of TaskGraph ids (.json), or a text file with one id per line."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"--order {path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UsageError(f"--order {path}: not a text file") from None
    if Path(path).suffix.lower() == ".json":
        try:
            order = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(
                f"--order {path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}"
            ) from None
        except RecursionError:
            raise UsageError(f"--order {path}: nested too deeply to be a list of vertex ids") from None
        if isinstance(order, dict):
            order = order.get("order")
        if not isinstance(order, list) or not all(isinstance(i, str) for i in order):
            raise UsageError(f'--order {path}: want a JSON list of vertex ids (or {{"order": [...]}})')
        return order
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
