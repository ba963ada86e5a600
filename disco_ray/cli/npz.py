"""Tensors in .npz files keyed by TaskGraph id: the inputs and outputs of `run`, `workload`, `job`.

numpy has no bfloat16: a bfloat16 tensor X is stored as the uint16 array X holding its raw bits
plus a string entry "X.__dtype__" = "bfloat16"; when reading inputs, a float32/float64 array is
also accepted for a bfloat16 input (rounded to bfloat16). Files are written atomically.
"""

from __future__ import annotations

from collections.abc import Mapping

from disco_ray.graph.errors import UsageError
from disco_ray.graph.files import replacing

DTYPE_SUFFIX = ".__dtype__"


def load_npz(path: str, tg=None) -> dict:
    """Tensors of an .npz file (bfloat16 as described in the module docstring); UsageError naming
    the file (and the array) for anything else: not an .npz, a damaged one, a non-number array."""
    import numpy as np
    import torch

    try:
        with np.load(path, allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise UsageError(f"{path}: a .npy file (one array); want an .npz of arrays keyed by input id")
            raw = {k: z[k] for k in z.files}
    except UsageError:
        raise
    except Exception as e:  # numpy and zipfile raise many kinds for a damaged or foreign file
        raise UsageError(f"{path}: cannot read as .npz ({type(e).__name__}: {e})") from None
    out = {}
    for k, a in raw.items():
        if k.endswith(DTYPE_SUFFIX):
            if k.removesuffix(DTYPE_SUFFIX) not in raw or str(a) != "bfloat16":
                raise UsageError(
                    f"{path}: entry {k!r} = {str(a)!r}: the only dtype tag is 'bfloat16' of an array"
                )
            continue
        if a.dtype.kind not in "biuf" or a.dtype.fields is not None:
            raise UsageError(f"{path}: array {k!r} has dtype {a.dtype}, not a number type")
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))  # a big-endian file: same numbers, this machine's order
        tag = raw.get(k + DTYPE_SUFFIX)
        if tag is not None and str(tag) == "bfloat16":
            if a.dtype.itemsize != 2:
                raise UsageError(
                    f"{path}: array {k!r} is tagged bfloat16 but holds {a.dtype}, not 16-bit words"
                )
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
    with replacing(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
