"""`ModelConfig`: a decoder-only model's config.json, parsed and checked, whatever its family.

The fields every LLaMA-style family shares (sizes, heads, norm epsilon, RoPE, tied embeddings,
dtype, end-of-sequence ids) are read here; a family (`families.base.Family`) reads its own fields
into the rest (biases, norms, windows, soft-caps, experts). Anything not understood is refused
with one `UsageError` naming the file and the field.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from disco_ray.graph.errors import UsageError

from ..layer import Activation, LayerSpec, LayerWeights, MoeSpec

ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class ModelConfig:
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
    family: str = "llama"  # its model_type: the `Family` that reads it and names its tensors
    act: Activation = Activation.SILU
    scale: float | None = None  # attention's softmax scale (None: head_dim ** -0.5)
    # a layer's checkpoint tensors by role (its family's)
    weights: LayerWeights = field(default_factory=LayerWeights)
    # nonzero dropout fields (name, p): none at inference; training refuses them
    dropout: tuple[tuple[str, float], ...] = ()
    # per layer, its sliding attention window (None: full attention); empty: every layer full
    windows: tuple[int | None, ...] = ()
    # Gemma 2: norms scaled by (norm_offset + w), embeddings by sqrt(dim), attention scores and
    # final logits soft-capped (None: not)
    norm_offset: float = 0.0
    embed_scale: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    moe: MoeSpec | None = None  # a sparse mixture of experts instead of the MLP (Mixtral)

    @property
    def spec(self) -> LayerSpec:
        """Its decoder layers, as the layer builder takes them."""
        hd = self.head_dim
        scale = hd**-0.5 if self.scale is None else self.scale
        return LayerSpec(
            self.dim,
            self.heads,
            self.kv_heads,
            hd,
            self.ffn,
            self.eps,
            scale,
            self.rope_theta,
            self.rope,
            act=self.act,
            weights=self.weights,
            windows=self.windows,
            norm_offset=self.norm_offset,
            softcap=self.attn_softcap,
            moe=self.moe,
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


def common(cfg: dict, where: str, gen: dict | None) -> dict:
    """The fields every family shares, as `ModelConfig` keyword arguments."""
    get = functools.partial(read, cfg, where)
    dim, heads = get("hidden_size"), get("num_attention_heads")
    kv = get("num_key_value_heads", default=heads)
    if heads % kv:
        raise UsageError(f"{where}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    hd = get("head_dim", default=None)
    if hd is None:
        if dim % heads:
            raise UsageError(f"{where}: hidden_size {dim} is not a multiple of num_attention_heads {heads}")
        hd = dim // heads
    if hd % 2:
        raise UsageError(f"{where}: head_dim {hd} must be even (rotary embedding)")
    theta, rope = _rope(cfg, where)
    eps = get("rms_norm_eps", (int, float), 1e-6)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise UsageError(f"{where}: dtype {dtype!r} is not supported (float32, float16, bfloat16)")
    eos = (gen or {}).get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
        raise UsageError(f"{where}: eos_token_id must be an integer or a list of them, got {eos!r}")
    max_pos = get("max_position_embeddings", default=2048)
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", max_pos)
    return dict(
        vocab=get("vocab_size"),
        dim=dim,
        layers=get("num_hidden_layers"),
        heads=heads,
        kv_heads=kv,
        head_dim=hd,
        ffn=get("intermediate_size"),
        eps=float(eps),
        rope_theta=theta,
        rope=rope,
        tie=bool(cfg.get("tie_word_embeddings", False)),
        max_positions=max_pos,
        dtype=dtype,
        eos=eos_ids,
    )


def read(
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
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # rotating part of each head changes the computation: not implemented
        raise UsageError(f"{where}: partial_rotary_factor {partial!r} is not supported (only 1.0)")
    rope["rope_type"] = rtype
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    for key in need.get(rtype, ()):
        x = rope.get(key)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
            raise UsageError(f"{where}: rope_scaling {rtype} needs a positive {key!r}, got {x!r}")
    return float(theta), rope
