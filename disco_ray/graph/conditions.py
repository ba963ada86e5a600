"""Conditional TaskGraph vertices (docs/FORMATS.md, "Conditional vertices"): a vertex skipped at
run time unless a column of a flag (a kernel's [rows, n] float32 output, e.g. a mixture's router
choice) has a non-zero row. Plans reserve and order them as if they ran (planner.conditions)."""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from typing import Any

from .errors import GraphError


def condition(vertices: MutableMapping[str, Any], id: str, flag: str, index: int) -> None:
    """Makes vertex `id` of a TaskGraph's `vertices` conditional on column `index` of `flag` (a [rows, n] float32
    kernel output on its GPU): a run skips it (its load moves no bytes, its kernel does not run)
    unless that column of this flag, or of another flag it is conditional on, has a non-zero
    row. The readers of a conditional value must be conditional too, or read the flag and ignore
    the value where its column is zero (`moe_combine`). A flag that depends on the vertex is
    refused when the graph is planned (`planner.conditions.after_flags`)."""
    where = f"vertex {id!r}: condition"
    v, f = vertices.get(id), vertices.get(flag)
    if v is None or f is None:
        raise GraphError(f"{where}: no such vertex {id if v is None else flag!r}")
    if f.op is None or f.dtype != "float32" or len(f.shape) != 2 or f.gpu != v.gpu:
        raise GraphError(f"{where}: flag {flag!r} must be a float32 [rows, n] kernel output on gpu {v.gpu}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < f.shape[1]:
        raise GraphError(f"{where}: index {index!r} out of range 0..{f.shape[1] - 1} of flag {flag!r}")
    if f.when or id == flag:
        raise GraphError(f"{where}: flag {flag!r} is itself conditional")
    if (flag, index) not in v.when:
        vertices[id] = dataclasses.replace(v, when=(*v.when, (flag, index)))
