"""Output files that appear whole or not at all.

Every file the command line writes (plans, traces, results, .npz outputs and logits, plots, an
adapter's files) is written under a temporary name in its own directory, then renamed over its
final name (`os.replace`: atomic on one file system). A failure on the way (a full disk, Ctrl-C,
a bad value found late) removes the temporary file, so the path holds the previous file or
nothing, never half of one. A new directory of files (an adapter) is made aside and renamed in
the same way (`new_directory`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def umask() -> int:
    """The process's umask now: temporary files are private (0600), the renamed output gets the
    mode a file the user created now would get. Read from /proc where Linux shows it (reading it
    with os.umask means setting it, which another thread could see); else set and put back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` (its suffix kept: writers that choose a format by it see the
    right one) for the block to write; renamed to `path` when the block ends, removed if it raises."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix or ".tmp")
    except OSError as e:  # no such directory, no permission: named as the output, not the temporary
        raise OSError(e.errno, e.strerror, str(path)) from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is None or str(e.filename) == tmp:  # named as the output it was for
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    finally:
        Path(tmp).unlink(missing_ok=True)  # gone after the rename; else what a failure left


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path` atomically (`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def new_directory(path: str | os.PathLike) -> Iterator[Path]:
    """The directory to write `path`'s files into: a hidden sibling, whose files all appear in
    `path` when the block ends, or none if it raises. When `path` does not exist the sibling is
    renamed to it (a failure leaves no directory, not even an empty one); when it does, each file
    is renamed over its old one after every file is written (a failure leaves the previous files
    whole; files the block does not write stay)."""
    path = Path(path)
    existed = path.is_dir()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        files = sorted(tmp.iterdir())
        for f in files:  # writers that make their files private (safetensors': 0600) too
            f.chmod(0o666 & ~umask())
        if existed:
            for f in files:
                os.replace(f, path / f.name)
        else:
            tmp.chmod(0o777 & ~umask())
            os.rename(tmp, path)
    except OSError as e:
        if e.filename is not None and str(e.filename).startswith(str(tmp)):  # named as the user named it
            raise OSError(e.errno, e.strerror, str(path) + str(e.filename)[len(str(tmp)) :]) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; else what a failure left
