"""A quantized checkpoint on disk (`disco-ray quantize`): the weights a model reads quantized,
written packed once, so that every later load streams the packed bytes and quantizes nothing.

The output is a checkpoint directory of the same files (docs/FORMATS.md): each safetensors file
holds the same tensors, those the model packs (the decoder layers' projections at `bits`, the
embedding table and LM head at 8 bits: docs/QUANTIZATION.md) as U8 tensors of the packed layout
of `disco_ray.graph.quant`, the others as stored; each file's metadata records its packed tensors'
float shapes, bits and group and the layout version; config.json gets a `quantization_config`;
the tokenizer's and the other small files are copied. Which tensors are packed, and how, is what
the model's graph builder reads packed (one decode graph's sources), so a quantized checkpoint
holds exactly the bytes quantizing at load would make.

Written into a hidden sibling directory renamed at the end (`disco_ray.graph.files.new_directory`):
a failure leaves no output directory.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch

from disco_ray.graph import sources
from disco_ray.graph.errors import UsageError
from disco_ray.graph.files import new_directory
from disco_ray.graph.kernels_quant import quantize
from disco_ray.graph.quant import DEFAULT_GROUP, LAYOUT_VERSION, Quant
from workloads.llm.checkpoint import QUANT_METHOD, Checkpoint

log = logging.getLogger("disco_ray")
INDEX = "model.safetensors.index.json"
# weights in other formats: a float copy of the model, not copied next to the packed one
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
CHUNK_BYTES = 64 << 20  # float32 bytes quantized at a time: a large tensor's temporaries stay bounded


def packed_tensors(ck: Checkpoint) -> dict[str, Quant]:
    """The tensors a model of `ck` (quantized: `ck.quant`) reads packed, and how: those its graph
    builder gives a quantized source (one GPU's decode graph reads every weight)."""
    from workloads.llm.model import decode_graph

    tg = decode_graph(ck, 1, 1, 1).taskgraph
    return {
        v.source.tensor: v.source.quant for v in tg if v.source is not None and v.source.quant is not None
    }


def quantize_checkpoint(model_dir: str, out_dir: str, bits: int, group: int = DEFAULT_GROUP) -> dict:
    """Writes checkpoint `model_dir` quantized (`bits` 8 or 4, `group` elements per scale and zero
    point) into the new directory `out_dir`; returns what it wrote (files, tensors, bytes, seconds).

    Raises:
        UsageError: bad bits or group, `model_dir` is no checkpoint or is quantized already,
            `out_dir` exists and is not an empty directory, a tensor cannot be quantized.
        NonFiniteError: a packed weight holds NaN or infinity (named).
    """
    q = Quant(bits, group)
    ck = Checkpoint(model_dir)
    if ck.stored_quant is not None:
        have = ck.stored_quant
        raise UsageError(
            f"{model_dir}: quantized already ({have.name}, group {have.group}): give the float checkpoint"
        )
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out_dir}: exists and is not an empty directory: give a new one")
    t0 = time.perf_counter()
    plan = packed_tensors(ck.quantized(q))
    files = sorted({f for f, _, _ in ck.tensors.values()})
    src = Path(model_dir)
    written = 0
    with new_directory(out) as tmp:
        for f in files:
            written += _write_file(f, plan, tmp / Path(f).name)
        _write_config(src / "config.json", tmp / "config.json", q)
        if (src / INDEX).exists():
            doc = json.loads((src / INDEX).read_text())
            doc["metadata"] = dict(doc.get("metadata") or {}, total_size=written)
            (tmp / INDEX).write_text(json.dumps(doc, indent=2) + "\n")
        for p in sorted(src.iterdir()):  # the tokenizer's files, generation_config.json, ...
            skip = (
                p.name.startswith(".") or p.name in ("config.json", INDEX) or p.name.endswith(WEIGHT_SUFFIXES)
            )
            if p.is_file() and not skip:
                shutil.copyfile(p, tmp / p.name)  # not copy2: the new file's mode is the umask's
    return {
        "out": str(out),
        "quant": q.to_dict(),
        "files": len(files),
        "tensors": len(ck.tensors),
        "packed": len(plan),
        "bytes_in": sum(Path(f).stat().st_size for f in files),
        "bytes_out": written,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _write_file(path: str, plan: dict[str, Quant], out: Path) -> int:
    """Safetensors file `path` written to `out` with the tensors of `plan` packed; its bytes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, dict] = {}
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata() or {})
        for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            t = f.get_tensor(name)
            q = plan.get(name)
            if q is not None:
                tensors[name] = _pack(t, q, f"{path}: tensor {name!r}")
                records[name] = {"bits": q.bits, "group": q.group, "shape": list(t.shape)}
            else:
                tensors[name] = t
    meta.setdefault("format", "pt")
    if records:
        meta |= {
            sources.LAYOUT_KEY: str(LAYOUT_VERSION),
            sources.PACKED_KEY: json.dumps(records, sort_keys=True),
        }
    save_file(tensors, str(out), metadata=meta)
    log.debug("%s: %d of %d tensors packed", out.name, len(records), len(tensors))
    return out.stat().st_size


def _pack(t: torch.Tensor, q: Quant, what: str) -> torch.Tensor:
    """Weight `t` packed by `q`, as a worker quantizing at load packs it (in row chunks: each
    row is packed alone, so the bytes are the same)."""
    sources.check_finite(t, what)  # as a worker reading a checkpoint's weight checks it
    rows = max(1, CHUNK_BYTES // (4 * max(1, t.shape[1])))
    try:
        return torch.cat([quantize(t[r : r + rows], q) for r in range(0, t.shape[0], rows)])
    except ValueError as e:
        raise UsageError(f"{what}: cannot be quantized: {e}") from None


def _write_config(src: Path, out: Path, q: Quant) -> None:
    """config.json with the quantization recorded (`quantization_config`, as transformers'
    quantized checkpoints record theirs)."""
    cfg = json.loads(src.read_text())
    cfg["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "layout_version": LAYOUT_VERSION,
        "bits": q.bits,
        "group_size": q.group,
    }
    out.write_text(json.dumps(cfg, indent=2) + "\n")
