"""A Hugging Face LLaMA-family checkpoint directory, read without loading its weights.

`Checkpoint(path)` reads `config.json` (and `generation_config.json` when present), finds which
`.safetensors` file holds each tensor (`model.safetensors`, or the shards that
`model.safetensors.index.json` maps), and reads each tensor's shape and dtype from the file
headers. Weights are never read here: a graph names blocks of them as input `Source`s and each
worker reads its own (`disco_ray.graph.sources`).

The config is read by its family (`workloads.llm.families`, by `model_type`), which refuses what
it does not implement, naming the field; the family names every tensor the checkpoint must hold,
and a tensor it does not name is refused too (a weight the model would not use means a different
model). A weight stored as other than F32, F16 or BF16 is refused by its tensor name. Its sources are `finite`: the
worker reading a block refuses one holding NaN or infinity, naming the tensor.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

from disco_ray.graph.errors import UsageError
from disco_ray.graph.quant import Quant
from disco_ray.graph.sources import CONFIG_ONLY, FILE_DTYPES, Source

from .families import FAMILIES, ModelConfig, parse_config

CONFIG_ONLY_FILE = f"{CONFIG_ONLY}/model.safetensors"
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")  # the weights' dtypes a checkpoint may store
FILE_NAMES = {ours: theirs for theirs, ours in FILE_DTYPES.items()}  # for messages: safetensors' names


class Checkpoint:
    """A checkpoint directory: its config and where each tensor is (file, shape, dtype)."""

    def __init__(self, path: str | Path):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise UsageError(f"{path}: not a checkpoint directory")
        cfg_path = self.path / "config.json"
        cfg = _read_json(cfg_path)
        gen_path = self.path / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.exists() else None
        self.config = parse_config(cfg, str(cfg_path), gen)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            doc = _read_json(index)
            wm = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(f, str) for f in wm.values()):
                raise UsageError(f'{index}: no "weight_map" object of tensor -> file')
            files = sorted(set(wm.values()))
        elif single.exists():
            files = [single.name]
        else:
            raise UsageError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}  # name -> (file, shape, dtype)
        for name in files:
            # absolute: a worker of a running cluster reads it from another working directory
            fp = (self.path / name).absolute()
            try:
                with safe_open(str(fp), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                        sl = f.get_slice(key)
                        dt = FILE_DTYPES.get(sl.get_dtype(), sl.get_dtype())
                        self.tensors[key] = (str(fp), tuple(sl.get_shape()), dt)
            except (OSError, SafetensorError) as e:
                raise UsageError(f"{fp}: not a readable safetensors file ({e})") from None
        self._check()

    config_only = False  # True: no files behind it (`from_config`); its sources refuse to be read
    quant: Quant | None = None  # the decoder layers' projections are quantized where read (`quantized`)

    kv_cache: Quant | None = None  # a batch's KV cache blocks stored packed so (`with_kv_cache`)

    def with_kv_cache(self, kv: Quant | None) -> Checkpoint:
        """This checkpoint with its batch graphs' KV cache blocks stored as `kv` packs them, group-wise
        within each head (docs/QUANTIZATION.md#kv-cache-in-8-bits; None: in the compute dtype)."""
        ck = copy.copy(self)
        ck.kv_cache = kv
        return ck

    def quantized(self, quant: Quant | None) -> Checkpoint:
        """This checkpoint with its decoder layers' linear weights read as `quant` packs them
        (None: as stored); the embeddings, norms and LM head stay in the compute dtype."""
        ck = copy.copy(self)
        ck.quant = quant
        return ck

    @classmethod
    def virtual(cls, config: ModelConfig, dtype: str = "float16") -> Checkpoint:
        """A checkpoint of `config`'s shapes whose files do not exist: for graphs that are planned
        and simulated, never run (the papers' 7B and 65B settings). A worker asked to read one of
        its tensors refuses with one error (`disco_ray.graph.sources.read`)."""
        if dtype not in ("float32", "float16", "bfloat16"):
            raise UsageError(
                f"config-only checkpoint: dtype {dtype!r} is not supported (float32, float16, bfloat16)"
            )
        ck = cls.__new__(cls)
        ck.path = Path(CONFIG_ONLY)
        ck.config = config
        ck.config_only = True
        ck.tensors = {name: (CONFIG_ONLY_FILE, shape, dtype) for name, shape in _shapes(config).items()}
        return ck

    @classmethod
    def from_config(cls, config: dict | ModelConfig, dtype: str | None = None) -> Checkpoint:
        """A checkpoint with no weights on disk: a config.json object (or a parsed `ModelConfig`)
        says its tensors' names and shapes, `dtype` (default: the config's) their dtype. For
        predictions (plan and simulate a model one does not have); UsageError as `Checkpoint` for
        an unsupported config, naming the field."""
        cfg = parse_config(config, "config") if isinstance(config, dict) else config
        if dtype is not None:  # the model's dtype: its graphs compute in it by default
            cfg = dataclasses.replace(cfg, dtype=dtype)
        return cls.virtual(cfg, cfg.dtype)

    def parameters(self) -> int:
        """Number of parameters (elements of every weight tensor)."""
        return sum(math.prod(s) for _, s, _ in self.tensors.values())

    def _check(self) -> None:
        want = _shapes(self.config)
        unused = sorted(set(self.tensors) - set(want))
        if unused:
            name = unused[0]
            raise UsageError(
                f"{self.tensors[name][0]}: tensor {name!r} is not used by model_type "
                f"{self.config.family!r}: refused rather than computing a different model"
            )
        for name, shape in want.items():
            got = self.tensors.get(name)
            if got is None:
                raise UsageError(f"{self.path}: the checkpoint has no tensor {name!r}")
            if got[1] != shape:
                raise UsageError(
                    f"{got[0]}: tensor {name!r} has shape {list(got[1])}, the config says {list(shape)}"
                )
            if got[2] not in WEIGHT_DTYPES:  # an integer read as a float computes garbage
                raise UsageError(
                    f"{got[0]}: tensor {name!r} has dtype {FILE_NAMES.get(got[2], got[2])}; a weight "
                    "must be F32, F16 or BF16"
                )

    def source(
        self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> Source:
        """The block of tensor `name` with rows [a, b) and columns [c, d) (None: all)."""
        file = self.tensors[name][0]
        slices: tuple = () if rows is None and cols is None else (rows, cols) if cols is not None else (rows,)
        return Source(file, name, slices, finite=True)  # a NaN weight never computes an answer

    def weight_bytes(self, dtype: str | None = None) -> int:
        """Bytes of all weights, as stored or (dtype given) converted."""
        from disco_ray.graph.dtypes import ITEMSIZE

        return sum(
            math.prod(s) * ITEMSIZE[dtype or dt] for _, s, dt in self.tensors.values() if dt in ITEMSIZE
        )


def _shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of config `c` holds, with their shapes (its family's)."""
    return FAMILIES[c.family].tensors(c)


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: missing") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: want a JSON object")
    return doc
