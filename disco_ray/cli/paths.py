"""Output paths checked before any work: a command that writes a file or a directory learns that
it cannot at argument time, not after a long run.

`writable_file(flag)` and `writable_dir(flag)` make the argparse types of output options; their
error is the one line "FLAG PATH: cannot write (why)", exit 2 (`check_writable` is the same check
for a path a command learns later). Each tries to make a temporary file where the output goes:
`os.access` cannot say what root on a read-only mount or a full quota may do.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from disco_ray.graph.errors import UsageError


def file_problem(path: str | Path) -> str | None:
    """Why no file can be written at `path`, as the OS says it (None: one can): a directory of
    that name, no such directory, or a directory that takes no new file."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        return _why(errno.EISDIR)
    if not parent.is_dir():
        return _why(errno.ENOTDIR if parent.exists() or _under_a_file(parent) else errno.ENOENT)
    return _try_write(parent)


def dir_problem(path: str | Path) -> str | None:
    """Why no output directory can be made or written at `path` (None: it can): a file of that
    name, or a nearest existing ancestor that is no directory or takes no new file."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return _why(errno.ENOTDIR)
    base = p.absolute()
    while not base.exists():  # the directory that would hold it, made when the output is written
        base = base.parent
    return _try_write(base) if base.is_dir() else _why(errno.ENOTDIR)


def _under_a_file(p: Path) -> bool:
    return any(a.exists() and not a.is_dir() for a in p.parents)


def _why(code: int) -> str:
    return f"cannot write ({os.strerror(code)})"


def _try_write(directory: Path) -> str | None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"cannot write ({e.strerror})"
    return None


def check_writable(path: str | Path, flag: str) -> None:
    """UsageError "FLAG PATH: cannot write (why)" when no file can be written at `path`."""
    problem = file_problem(path)
    if problem is not None:
        raise UsageError(f"{flag} {path}: {problem}")


def writable_file(flag: str):
    """The argparse type of output file option `flag`: its directory exists and takes a new
    file, and the path is no directory."""

    def parse(text: str) -> str:
        check_writable(text, flag)
        return text

    return parse


def writable_dir(flag: str):
    """The argparse type of output directory option `flag`: a directory that takes a new file,
    or a path where one can be made."""

    def parse(text: str) -> str:
        problem = dir_problem(text)
        if problem is not None:
            raise UsageError(f"{flag} {text}: {problem}")
        return text

    return parse
