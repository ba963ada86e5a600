"""Spill files by name, so that the driver can remove what a worker it killed (or lost) left.

A worker removes its spill file when its graph is unloaded (`SpillFile.close`); a worker that
dies, is killed by the pool after a failure (a stopped worker, Ctrl-C, SIGTERM, a full disk) or
is killed with its Ray at the end never gets there. Its files are named
`spill-gpu{G}-{PID}-{RANDOM}.bin`, in the run's disk directory (`--disk`) or, without one, in a
`disco-spill-*` directory of the temporary directory; the pool, which knows its workers' process
ids and the directories it asked them to use, removes the files of those processes once they
are gone (`remove_left`). Only files on the driver's node can be reached that way.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import uuid
from collections.abc import Iterable

TEMP_PREFIX = "disco-spill-"  # a spill directory made for a worker without a disk directory


def spill_name(gpu: int, pid: int) -> str:
    """The file name of GPU `gpu`'s spill file made by process `pid` (unique per file)."""
    return f"spill-gpu{gpu}-{pid}-{uuid.uuid4().hex[:8]}.bin"


def owner(name: str) -> int | None:
    """The process id in a spill file's name (`spill_name`), None for any other name."""
    parts = name.removesuffix(".bin").split("-")
    if len(parts) != 4 or parts[0] != "spill" or not parts[1].startswith("gpu") or not name.endswith(".bin"):
        return None
    return int(parts[2]) if parts[2].isdigit() else None


def remove_left(directory: str | None, pids: Iterable[int]) -> list[str]:
    """Removes the spill files that processes `pids` (gone) made in `directory`; with None, in the
    `disco-spill-*` directories of the temporary directory, each removed too once empty (a live
    worker's file keeps it). Returns the paths removed."""
    gone = set(pids)
    if directory is not None:
        dirs = [directory]
    else:
        dirs = glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), TEMP_PREFIX + "*"))
    removed = []
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:  # not there (a spill-free run) or not ours to read
            continue
        for name in names:
            if owner(name) in gone:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, name))
                    removed.append(os.path.join(d, name))
        if directory is None and any(os.path.dirname(p) == d for p in removed):
            with contextlib.suppress(OSError):
                os.rmdir(d)
    return removed
