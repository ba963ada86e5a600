"""Tensors in .npz files keyed by TaskGraph id: the inputs and outputs of `run`, `workload`, `job`.

numpy has no bfloat16: a bfloat16 tensor X is stored as the uint16 array X holding its raw bits
plus a string entry "X.__dtype__" = "bfloat16"; when reading inputs, a float32/float64 array is
also accepted for a bfloat16 input (rounded to bfloat16). Files are written atomically.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from disco_ray.graph.errors import UsageError

DTYPE_SUFFIX = ".__dtype__"


def load_npz(path: str, tg=None) -> dict:
    """Tensors of an .npz file (bfloat16 as described in the module docstring)."""
    import numpy as np
    import torch

    try:
        with np.load(path, allow_pickle=False) as z:
            raw = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read as .npz ({e})") from None
    out = {}
    for k, a in raw.items():
        if k.endswith(DTYPE_SUFFIX):
            continue
        tag = raw.get(k + DTYPE_SUFFIX)
        if tag is not None and str(tag) == "bfloat16":
            t = torch.from_numpy(a.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(a))
            if tg is not None and k in tg and tg[k].dtype == "bfloat16" and a.dtype.kind == "f":
                t = t.to(torch.bfloat16)
        out[k] = t
    return out


def save_npz(path: str, tensors: Mapping) -> None:
    """Writes tensors to .npz atomically; bfloat16 as uint16 bits + a dtype entry."""
    import numpy as np
    import torch

    arrays = {}
    for k, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            arrays[k] = t.view(torch.int16).numpy().view(np.uint16)
            arrays[k + DTYPE_SUFFIX] = np.array("bfloat16")
        else:
            arrays[k] = t.numpy()
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent if str(p.parent) else ".", prefix=f".{p.name}.", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
