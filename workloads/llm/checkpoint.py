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

A quantized checkpoint (`disco-ray quantize`: config.json's `quantization_config`, docs/FORMATS.md)
holds some weights packed (U8, the layout of `disco_ray.graph.quant`, their float shapes, bits and
group in each file's metadata): `tensors` gives their float shapes, `stored` how they are packed,
and their sources are read as stored (`Source.packed`), never quantized again.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

from disco_ray.graph.errors import UsageError
from disco_ray.graph.quant import LAYOUT_VERSION, Quant
from disco_ray.graph.sources import CONFIG_ONLY, FILE_DTYPES, Source, packed_records

from .families import FAMILIES, ModelConfig, parse_config

CONFIG_ONLY_FILE = f"{CONFIG_ONLY}/model.safetensors"
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")  # the weights' dtypes a checkpoint may store
FILE_NAMES = {ours: theirs for theirs, ours in FILE_DTYPES.items()}  # for messages: safetensors' names
QUANT_METHOD = "disco-ray"  # a quantized checkpoint's quantization_config.quant_method


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
        self.quant = self.stored_quant = _stored_quant(cfg, str(cfg_path))
        self.stored: dict[str, Quant] = {}  # the tensors the files hold packed, and how
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
                    packed = _packed_records(f.metadata(), str(fp), self.stored_quant)
                    for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                        sl = f.get_slice(key)
                        dt = FILE_DTYPES.get(sl.get_dtype(), sl.get_dtype())
                        self.tensors[key] = (str(fp), tuple(sl.get_shape()), dt)
                        if key in packed:
                            self.tensors[key] = self._packed(str(fp), key, dt, *packed.pop(key))
                    if packed:
                        raise UsageError(
                            f"{fp}: its metadata records tensor {next(iter(packed))!r}, which it lacks"
                        )
            except (OSError, SafetensorError) as e:
                raise UsageError(f"{fp}: not a readable safetensors file ({e})") from None
        if self.stored_quant is not None and not self.stored:
            raise UsageError(f"{cfg_path}: a quantization_config, but no file holds a packed tensor")
        self._check()

    def _packed(self, file: str, name: str, dtype: str, q: Quant, shape: tuple[int, int]) -> tuple:
        """Tensor `name` of `file`, recorded packed by `q` from float `shape`, checked to be so."""
        got = self.tensors[name][1]
        if dtype != "uint8" or got != q.packed_shape(shape):
            raise UsageError(
                f"{file}: tensor {name!r} is {FILE_NAMES.get(dtype, dtype)} {list(got)}; packed "
                f"({q.name}, group {q.group}) from {list(shape)} it is U8 {list(q.packed_shape(shape))}"
            )
        self.stored[name] = q
        return file, shape, dtype

    config_only = False  # True: no files behind it (`from_config`); its sources refuse to be read
    quant: Quant | None = None  # the decoder layers' projections are quantized where read (`quantized`)
    stored_quant: Quant | None = None  # a quantized checkpoint's bits and group (its config.json's)
    stored: dict[str, Quant] = {}  # the tensors stored packed (a new dict per instance read)

    kv_cache: Quant | None = None  # a batch's KV cache blocks stored packed so (`with_kv_cache`)

    def with_kv_cache(self, kv: Quant | None) -> Checkpoint:
        """This checkpoint with its batch graphs' KV cache blocks stored as `kv` packs them, group-wise
        within each head (docs/QUANTIZATION.md#kv-cache-in-8-bits; None: in the compute dtype)."""
        ck = copy.copy(self)
        ck.kv_cache = kv
        return ck

    def quantized(self, quant: Quant | None) -> Checkpoint:
        """This checkpoint with its decoder layers' linear weights read as `quant` packs them
        (None: as stored; the embedding table and LM head: docs/QUANTIZATION.md). A quantized
        checkpoint is read with its own bits and group (None: as it was packed).

        Raises:
            UsageError: `quant` is not a quantized checkpoint's bits and group.
        """
        have = self.stored_quant
        if have is not None and quant is not None and (quant.bits, quant.group) != (have.bits, have.group):
            raise UsageError(
                f"{self.path}: quantized {have.name}, group {have.group} (config.json's "
                f"quantization_config): quantize {quant.name} with group {quant.group} conflicts; "
                "leave quantize out to read it as stored"
            )
        ck = copy.copy(self)
        ck.quant = have if quant is None else quant
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
            if (
                got[2] not in WEIGHT_DTYPES and name not in self.stored
            ):  # an integer read as a float computes garbage
                raise UsageError(
                    f"{got[0]}: tensor {name!r} has dtype {FILE_NAMES.get(got[2], got[2])}; a weight "
                    "must be F32, F16 or BF16"
                )

    def source(
        self,
        name: str,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
        packed: Quant | None = None,
    ) -> Source:
        """The block of tensor `name` with rows [a, b) and columns [c, d) (None: all), read
        quantized by `packed` (None: as floats).

        Raises:
            UsageError: the tensor is stored packed otherwise, or cut off its groups (`cols`).
        """
        file = self.tensors[name][0]
        slices: tuple = () if rows is None and cols is None else (rows, cols) if cols is not None else (rows,)
        q = self.stored.get(name)
        if q is None:  # a NaN weight never computes an answer
            return Source(file, name, slices, finite=True, quant=packed)
        if packed is None or (q.bits, q.group) != (packed.bits, packed.group):  # packed otherwise
            how = "as floats" if packed is None else f"as {packed.name}, group {packed.group}"
            raise UsageError(
                f"{file}: tensor {name!r} is stored packed ({q.name}, group {q.group}); it is read {how}"
            )
        if cols is not None:  # a packed block is cut out of the packed rows: on group boundaries
            try:
                q.column_spans(self.tensors[name][1][1], *cols)
            except UsageError as e:
                raise UsageError(
                    f"{file}: tensor {name!r} (stored {q.name}, group {q.group}): {e}: split it over "
                    "GPUs at group boundaries, or quantize at load from the float checkpoint"
                ) from None
        return Source(file, name, slices, quant=packed, packed=True)

    def weight_bytes(self, dtype: str | None = None) -> int:
        """Bytes of all weights, as stored or (dtype given) converted."""
        from disco_ray.graph.dtypes import ITEMSIZE

        return sum(
            math.prod(self.stored[n].packed_shape(s))
            if n in self.stored
            else math.prod(s) * ITEMSIZE[dtype or dt]
            for n, (_, s, dt) in self.tensors.items()
            if dt in ITEMSIZE
        )


def _stored_quant(cfg: dict, where: str) -> Quant | None:
    """A quantized checkpoint's bits and group, from config.json `cfg`'s quantization_config
    (None: it has none); UsageError naming `where` for one disco-ray does not read."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != QUANT_METHOD:
        raise UsageError(
            f"{where}: quantization_config with quant_method {method!r} is not read here (only "
            f"{QUANT_METHOD!r}, which `disco-ray quantize` writes): give the float checkpoint"
        )
    if qc.get("layout_version") != LAYOUT_VERSION:
        raise UsageError(
            f"{where}: quantization_config layout_version {qc.get('layout_version')!r}, this disco-ray "
            f"reads {LAYOUT_VERSION}: quantize the float checkpoint again"
        )
    try:
        return Quant(qc.get("bits"), qc.get("group_size"))  # type: ignore[arg-type]
    except UsageError as e:
        raise UsageError(f"{where}: quantization_config: {e}") from None


def _packed_records(
    meta: dict | None, file: str, quant: Quant | None
) -> dict[str, tuple[Quant, tuple[int, int]]]:
    """The tensors safetensors file `file` records packed in its metadata `meta`: name -> (how,
    float shape); UsageError naming the file for a bad record or another layout version."""
    try:
        out = packed_records(meta)
    except ValueError as e:
        raise UsageError(f"{file}: {e}: quantize the float checkpoint again") from None
    if out and quant is None:
        raise UsageError(f"{file}: holds packed tensors, but config.json has no quantization_config")
    return out


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
