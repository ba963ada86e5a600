"""Reading and writing TaskGraph / MemGraph documents as JSON or msgpack, chosen by file suffix."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import overload

import msgpack

from .errors import FormatError, GraphError
from .files import write_bytes
from .memgraph import MemGraph
from .taskgraph import TaskGraph

SUFFIXES = (".json", ".msgpack")


def _suffix(path: str | os.PathLike) -> str:
    s = Path(path).suffix.lower()
    if s not in SUFFIXES:
        raise FormatError(f"{path}: unknown file suffix {s or '(none)'!r} (use .json or .msgpack)")
    return s


def read_doc(path: str | os.PathLike) -> object:
    s = _suffix(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror})") from None
    try:
        if s == ".json":
            return json.loads(data)
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except json.JSONDecodeError as e:
        raise FormatError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise FormatError(f"{path}: nested too deeply to be a {s[1:]} graph document") from None
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
        raise FormatError(f"{path}: malformed msgpack: {e}") from None


def write_doc(doc: object, path: str | os.PathLike) -> None:
    """Writes atomically (`files.write_bytes`): a failed write leaves nothing half-written."""
    s = _suffix(path)
    data = json.dumps(doc, separators=(",", ":")).encode() if s == ".json" else msgpack.packb(doc)
    write_bytes(path, data)


def _with_path(exc: GraphError, path) -> GraphError:
    msg = str(exc)
    return type(exc)(msg if msg.startswith(str(path)) else f"{path}: {msg}")


@overload
def _load(path: str | os.PathLike, kind: type[TaskGraph]) -> TaskGraph: ...
@overload
def _load(path: str | os.PathLike, kind: type[MemGraph]) -> MemGraph: ...
@overload
def _load(path: str | os.PathLike, kind: None) -> TaskGraph | MemGraph: ...
def _load(path: str | os.PathLike, kind: type[TaskGraph] | type[MemGraph] | None) -> TaskGraph | MemGraph:
    """Reads a document and parses it as `kind` (None: by its "format" field)."""
    doc = read_doc(path)
    if kind is None:
        fmt = doc.get("format") if isinstance(doc, dict) else None
        kind = MemGraph if fmt == "disco-memgraph" else TaskGraph
    try:
        return kind.from_dict(doc)
    except GraphError as e:
        raise _with_path(e, path) from None


def load_taskgraph(path: str | os.PathLike) -> TaskGraph:
    return _load(path, TaskGraph)


def load_memgraph(path: str | os.PathLike) -> MemGraph:
    return _load(path, MemGraph)


def load_any(path: str | os.PathLike) -> TaskGraph | MemGraph:
    return _load(path, None)


def save(graph: TaskGraph | MemGraph, path: str | os.PathLike) -> None:
    write_doc(graph.to_dict(), path)
