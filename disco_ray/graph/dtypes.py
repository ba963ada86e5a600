"""Tensor element types of FORMATS.md, with their sizes; torch is imported only on demand."""

from __future__ import annotations

ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "bool": 1,
}
FLOATS = frozenset({"float16", "bfloat16", "float32"})


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def torch_dtype(dtype: str):
    import torch

    return getattr(torch, dtype)


def from_torch(dt) -> str:
    name = str(dt).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {name} is not one of {sorted(ITEMSIZE)}")
    return name


def from_numpy(dt) -> str:
    name = str(dt)
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {name} is not one of {sorted(ITEMSIZE)}")
    return name
