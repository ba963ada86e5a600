"""Training checkpoints: what `LoraTrainer` needs to continue a run exactly where it stopped.

A checkpoint directory `OUT/step-N/` holds

- `adapter_config.json`, `adapter_model.safetensors`: the adapter after step N in PEFT's layout
  (`adapter.save`: `PeftModel.from_pretrained` loads it);
- `optimizer.safetensors`: AdamW's moments of every adapter matrix (`KEY.exp_avg`,
  `KEY.exp_avg_sq`, whole matrices keyed as the adapter's, read back from the workers' states)
  and torch's RNG state (`rng.torch`);
- `trainer_state.json`: the step N, the data position (the next row of the data), the data's
  row count, the model's config, the LoRA and optimizer settings, the schedule, the losses.

It is written atomically: every file into a hidden directory beside it, each file and the
directory fsync'd, then renamed to `step-N` (an old `step-N` is moved aside first and removed
after): a crash while writing leaves the earlier checkpoints whole and no `step-N`, or the
previous one. `load` refuses a checkpoint whose model, LoRA settings, optimizer or tensor shapes
differ from the run resuming it, naming the field.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from disco_ray.graph.errors import UsageError
from disco_ray.graph.files import umask

from . import adapter

STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq")
VOLATILE = ("_name_or_path", "transformers_version")  # config.json keys that do not change the model


@dataclass(frozen=True, slots=True)
class TrainState:
    """A checkpoint's contents besides the adapter: `settings` is trainer_state.json's object."""

    step: int
    data_position: int
    data_rows: int
    settings: dict = field(default_factory=dict)
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    rng: torch.Tensor | None = None


def model_config(path: Path) -> dict:
    """The model's config.json without the keys that name rather than shape it."""
    cfg = json.loads((path / "config.json").read_text())
    return {k: v for k, v in cfg.items() if k not in VOLATILE}


def save(path: str | Path, lora, tensors: dict, base: str, state: TrainState) -> None:
    """Writes checkpoint directory `path` atomically (see the module's docstring)."""
    from safetensors.torch import save as serialize

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    aside = None
    try:
        adapter.save(tmp, lora, tensors, base)
        blobs = {
            f"{k}.{m}": v[i].contiguous() for k, v in state.moments.items() for i, m in enumerate(MOMENTS)
        }
        if state.rng is not None:
            blobs["rng.torch"] = state.rng
        _write(tmp / OPTIMIZER, serialize(blobs))
        doc = {"step": state.step, "data_position": state.data_position, "data_rows": state.data_rows}
        _write(tmp / STATE, json.dumps({**doc, **state.settings}, indent=2).encode())
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask())
            _fsync(f)
        tmp.chmod(0o777 & ~umask())
        _fsync(tmp)
        if path.exists():  # the same step again: the old one moved aside until the new one is in place
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.rename(path, aside / path.name)
        os.rename(tmp, path)
        _fsync(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and not path.exists():
            os.rename(aside / path.name, path)
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | Path, start: dict[str, torch.Tensor], expect: dict) -> TrainState:
    """The state of checkpoint `path` whose adapter (`start`, by key) was read by `adapter.load`;
    `expect`: the resuming run's settings (model, lora, optimizer), compared field by field.

    Raises:
        UsageError: a file missing or unreadable, or a setting or tensor shape that differs (named).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        doc = json.loads((path / STATE).read_text())
        blobs = load_file(str(path / OPTIMIZER))
    except FileNotFoundError as e:
        raise UsageError(
            f"--resume {path}: {Path(e.filename).name} missing: not a training checkpoint"
        ) from None
    except (OSError, ValueError, SafetensorError) as e:
        raise UsageError(f"--resume {path}: cannot read the checkpoint ({e})") from None
    for part, want in expect.items():
        _same(path, part, doc.get(part), want)
    moments = {}
    for k, t in start.items():
        if expect["optimizer"]["name"] != "adamw":
            break
        pair = []
        for m in MOMENTS:
            got = blobs.get(f"{k}.{m}")
            if got is None or tuple(got.shape) != tuple(t.shape):
                have = "missing" if got is None else f"shape {list(got.shape)}"
                raise UsageError(f"--resume {path}: {OPTIMIZER}: {k}.{m} is {have}, want {list(t.shape)}")
            pair.append(got)
        moments[k] = (pair[0], pair[1])
    for key in ("step", "data_position", "data_rows"):
        if isinstance(doc.get(key), bool) or not isinstance(doc.get(key), int) or doc[key] < 0:
            raise UsageError(f"--resume {path}: {STATE}: {key} must be an integer >= 0, got {doc.get(key)!r}")
    settings = {k: v for k, v in doc.items() if k not in ("step", "data_position", "data_rows")}
    return TrainState(
        doc["step"], doc["data_position"], doc["data_rows"], settings, moments, blobs.get("rng.torch")
    )


def _same(path: Path, part: str, got, want) -> None:
    """UsageError naming the first field of `part` whose checkpoint value differs from the run's."""
    want = json.loads(json.dumps(want))  # as the checkpoint holds it (tuples as lists)
    if got == want:
        return
    if isinstance(got, dict) and isinstance(want, dict):
        for k in sorted(set(got) | set(want)):
            if got.get(k) != want.get(k):
                raise UsageError(
                    f"--resume {path}: {part} {k} differs: {want.get(k)!r} in this run, "
                    f"{got.get(k)!r} in the checkpoint"
                )
    raise UsageError(f"--resume {path}: {part} differs: {want!r} in this run, {got!r} in the checkpoint")
