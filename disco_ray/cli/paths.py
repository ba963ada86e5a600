"""Output paths checked before any work: a command that writes a file or a directory learns that
it cannot at argument time, not after a long run.

`writable_file` and `writable_dir` are argparse types (argparse names the option in its one-line
error, exit 2); `check_writable(path, flag)` is the same check for a path a command learns later. Each tries to make a temporary file where the output goes: `os.access` cannot say
what root on a read-only mount or a full quota may do.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from disco_ray.graph.errors import UsageError


def file_problem(path: str | Path) -> str | None:
    """Why a file cannot be written at `path` (None: it can): a directory of that name, no such
    directory, or a directory it cannot be made in."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        return "is a directory"
    if not parent.is_dir():
        return f"no such directory {str(parent)!r}"
    return _try_write(parent)


def dir_problem(path: str | Path) -> str | None:
    """Why an output directory cannot be made or written at `path` (None: it can): a file of that
    name, or a nearest existing ancestor that is no writable directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return "not a directory"
    base = p.absolute()
    while not base.exists():  # the directory that would hold it, made when the output is written
        base = base.parent
    if not base.is_dir():
        return f"{base} is not a directory"
    return _try_write(base)


def _try_write(directory: Path) -> str | None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"cannot write in {str(directory)!r} ({e.strerror})"
    return None


def check_writable(path: str | Path, flag: str) -> None:
    """UsageError "FLAG PATH: why" when no file can be written at `path`."""
    problem = file_problem(path)
    if problem is not None:
        raise UsageError(f"{flag} {path}: {problem}")


def writable_file(text: str) -> str:
    """argparse type for an output file: its directory exists and takes files, the path is no
    directory."""
    problem = file_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return text


def writable_dir(text: str) -> str:
    """argparse type for an output directory: it exists and takes files, or can be made."""
    problem = dir_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return text
