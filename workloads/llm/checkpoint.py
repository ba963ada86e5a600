"""A Hugging Face LLaMA-family checkpoint directory, read without loading its weights.

`Checkpoint(path)` reads `config.json` (and `generation_config.json` when present), finds which
`.safetensors` file holds each tensor (`model.safetensors`, or the shards that
`model.safetensors.index.json` maps), and reads each tensor's shape and dtype from the file
headers. Weights are never read here: a graph names blocks of them as input `Source`s and each
worker reads its own (`disco_ray.graph.sources`).

Supported: `model_type` "llama" (LlamaForCausalLM), grouped-query attention
(`num_key_value_heads`), `head_dim`, tied embeddings, RoPE of type default, linear or llama3,
SiLU MLPs without biases. Anything else is refused with one `UsageError` naming the field; a
weight stored as other than F32, F16 or BF16, by its tensor name. Its sources are `finite`: the
worker reading a block refuses one holding NaN or infinity, naming the tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from disco_ray.graph.errors import UsageError
from disco_ray.graph.sources import CONFIG_ONLY, FILE_DTYPES, Source

from .layer import LayerSpec

CONFIG_ONLY_FILE = f"{CONFIG_ONLY}/model.safetensors"
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")  # the weights' dtypes a checkpoint may store
FILE_NAMES = {ours: theirs for theirs, ours in FILE_DTYPES.items()}  # for messages: safetensors' names
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab: int
    dim: int  # hidden_size
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # intermediate_size
    eps: float  # rms_norm_eps
    rope_theta: float
    rope: dict  # rope type and its parameters ({"rope_type": "default"} when none)
    tie: bool  # tie_word_embeddings
    max_positions: int
    dtype: str  # the checkpoint's dtype (config "dtype" or "torch_dtype")
    eos: tuple[int, ...]  # generation stops at these (generation_config.json, else config.json)

    @classmethod
    def from_dict(cls, cfg: dict, where: str, gen: dict | None = None) -> LlamaConfig:
        """Parses a config.json object; UsageError naming `where` and the field for what is unsupported."""
        field = functools.partial(_field, cfg, where)
        _check_llama(cfg, where)
        dim, heads = field("hidden_size"), field("num_attention_heads")
        kv = field("num_key_value_heads", default=heads)
        if heads % kv:
            raise UsageError(f"{where}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
        hd = field("head_dim", default=None)
        if hd is None:
            if dim % heads:
                raise UsageError(
                    f"{where}: hidden_size {dim} is not a multiple of num_attention_heads {heads}"
                )
            hd = dim // heads
        if hd % 2:
            raise UsageError(f"{where}: head_dim {hd} must be even (rotary embedding)")
        theta, rope = _rope(cfg, where)
        eps = field("rms_norm_eps", (int, float), 1e-6)
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        if dtype not in ("float32", "float16", "bfloat16"):
            raise UsageError(f"{where}: dtype {dtype!r} is not supported (float32, float16, bfloat16)")
        eos = (gen or {}).get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
            raise UsageError(f"{where}: eos_token_id must be an integer or a list of them, got {eos!r}")
        max_pos = field("max_position_embeddings", default=2048)
        if rope["rope_type"] == "llama3":
            rope.setdefault("original_max_position_embeddings", max_pos)
        return cls(
            vocab=field("vocab_size"),
            dim=dim,
            layers=field("num_hidden_layers"),
            heads=heads,
            kv_heads=kv,
            head_dim=hd,
            ffn=field("intermediate_size"),
            eps=float(eps),
            rope_theta=theta,
            rope=rope,
            tie=bool(cfg.get("tie_word_embeddings", False)),
            max_positions=max_pos,
            dtype=dtype,
            eos=eos_ids,
        )

    @property
    def spec(self) -> LayerSpec:
        """Its decoder layers, as the layer builder takes them."""
        hd, theta = self.head_dim, self.rope_theta
        return LayerSpec(
            self.dim, self.heads, self.kv_heads, hd, self.ffn, self.eps, hd**-0.5, theta, self.rope
        )

    def check_split(self, gpus: int) -> None:
        """Heads and the MLP must split evenly over `gpus` (tensor parallelism); key/value heads
        too, or each GPU holds a copy of the one key/value head its query heads share (when
        num_key_value_heads divides gpus, as Megatron replicates them)."""
        for name, n in (("num_attention_heads", self.heads), ("intermediate_size", self.ffn)):
            if n % gpus:
                raise UsageError(
                    f"config {name} {n} does not split over {gpus} GPUs (it must divide by {gpus})"
                )
        if self.kv_heads % gpus and gpus % self.kv_heads:
            raise UsageError(
                f"config num_key_value_heads {self.kv_heads} does not split over {gpus} GPUs (one must "
                "divide the other)"
            )


def _field(
    cfg: dict,
    where: str,
    name: str,
    typ: type[int] | tuple[type[int], type[float]] = int,
    default: object = ...,
    positive: bool = True,
):
    """Field `name` of config.json object `cfg` (at `where`), checked: of `typ`, positive."""
    if name not in cfg or cfg[name] is None:
        if default is ...:
            raise UsageError(f"{where}: missing {name!r}")
        return default
    x = cfg[name]
    if isinstance(x, bool) or not isinstance(x, typ):
        raise UsageError(f"{where}: {name!r} must be {getattr(typ, '__name__', 'a number')}, got {x!r}")
    if positive and not x > 0:
        raise UsageError(f"{where}: {name!r} must be positive, got {x!r}")
    return x


def _check_llama(cfg: dict, where: str) -> None:
    """A LLaMA architecture: model_type "llama", no biases, SiLU."""
    mt = cfg.get("model_type")
    if mt != "llama":
        arch = cfg.get("architectures")
        raise UsageError(
            f"{where}: model_type {mt!r} (architectures {arch}) is not supported: only LLaMA "
            "checkpoints (model_type 'llama', LlamaForCausalLM) are"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise UsageError(f"{where}: {flag} true is not supported (LLaMA layers have no biases)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")


def _rope(cfg: dict, where: str) -> tuple[float, dict]:
    """The rotary base and the scaling (its type under "rope_type") of a config.json object."""
    # transformers 5 writes "rope_parameters"; 4.x "rope_theta" and "rope_scaling"
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UsageError(f"{where}: rope_scaling must be an object, got {rope!r}")
    rope = dict(rope)
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise UsageError(
            f"{where}: rope_scaling type {rtype!r} is not supported (one of {', '.join(ROPE_TYPES)})"
        )
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise UsageError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    rope["rope_type"] = rtype
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    for key in need.get(rtype, ()):
        x = rope.get(key)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
            raise UsageError(f"{where}: rope_scaling {rtype} needs a positive {key!r}, got {x!r}")
    return float(theta), rope


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
        self.config = LlamaConfig.from_dict(cfg, str(cfg_path), gen)
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

    @classmethod
    def virtual(cls, config: LlamaConfig, dtype: str = "float16") -> Checkpoint:
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
    def from_config(cls, config: dict | LlamaConfig, dtype: str | None = None) -> Checkpoint:
        """A checkpoint with no weights on disk: a config.json object (or a parsed `LlamaConfig`)
        says its tensors' names and shapes, `dtype` (default: the config's) their dtype. For
        predictions (plan and simulate a model one does not have); UsageError as `Checkpoint` for
        an unsupported config, naming the field."""
        cfg = LlamaConfig.from_dict(config, "config") if isinstance(config, dict) else config
        if dtype is not None:  # the model's dtype: its graphs compute in it by default
            cfg = dataclasses.replace(cfg, dtype=dtype)
        return cls.virtual(cfg, cfg.dtype)

    def parameters(self) -> int:
        """Number of parameters (elements of every weight tensor)."""
        return sum(math.prod(s) for _, s, _ in self.tensors.values())

    def _check(self) -> None:
        for name, shape in _shapes(self.config).items():
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


def _shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a LLaMA checkpoint of config `c` holds, with their shapes."""
    want: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab, c.dim),
        "model.norm.weight": (c.dim,),
    }
    if not c.tie:
        want["lm_head.weight"] = (c.vocab, c.dim)
    spec = c.spec
    for i in range(c.layers):
        want |= {f"model.layers.{i}.{name}": spec.whole(role) for role, name in spec.weights.items()}
    return want


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
