"""Gemma 2 (`Gemma2ForCausalLM`): the shared layer with four norms per layer, norms scaled by
(1 + w), a GELU (tanh) MLP, embeddings scaled by sqrt(hidden_size), attention scaled by
query_pre_attn_scalar ** -0.5, attention scores and final logits soft-capped, tied embeddings,
and sliding-window attention on alternate layers.

The layer (transformers' Gemma2DecoderLayer): h1 = h + post_attention_layernorm(attention(
input_layernorm(h))); h2 = h1 + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h1))).
The post norms are the builder's `attn_post_norm` and `mlp_post_norm`, applied to the sum of the
GPUs' partial outputs (`Layer.all_reduce`).

Sliding windows: the per-layer windows (`layer_windows`, from `layer_types`) become
`ModelConfig.windows`, which the layers attend with (Mistral's sliding-window attention).
"""

from __future__ import annotations

import functools

from disco_ray.graph.errors import UsageError

from ..layer import Activation, LayerWeights
from .base import Family
from .config import read

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_windows(cfg: dict, where: str) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), from `layer_types`, else the rule of
    older configs (transformers' Gemma2Config: even layers slide)."""
    layers = read(cfg, where, "num_hidden_layers")
    window = read(cfg, where, "sliding_window", default=None)
    types = cfg.get("layer_types")
    if types is None:
        types = [LAYER_TYPES[i % 2] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise UsageError(
            f"{where}: layer_types must list {layers} of {', '.join(map(repr, LAYER_TYPES))}, got {types!r}"
        )
    if window is None and "sliding_attention" in types:
        raise UsageError(f"{where}: layer_types has sliding_attention layers but no sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _softcap(cfg: dict, where: str, name: str, default: float) -> float | None:
    """A soft-cap field: a positive number, or null for none (absent: transformers' default)."""
    if name in cfg and cfg[name] is None:
        return None
    return float(read(cfg, where, name, (int, float), default))


def _features(cfg: dict, where: str) -> dict:
    get = functools.partial(read, cfg, where)
    kw = {
        "windows": layer_windows(cfg, where),
        "scale": float(get("query_pre_attn_scalar", (int, float), 256)) ** -0.5,
        "norm_offset": 1.0,
        "embed_scale": True,
        "attn_softcap": _softcap(cfg, where, "attn_logit_softcapping", 50.0),
        "final_softcap": _softcap(cfg, where, "final_logit_softcapping", 30.0),
        "tie": bool(cfg.get("tie_word_embeddings", True)),  # Gemma 2 ties them unless told not to
    }
    if "head_dim" not in cfg:  # transformers' default, not hidden_size / heads
        raise UsageError(f"{where}: missing 'head_dim' (Gemma 2 sets it apart from hidden_size)")
    if "hidden_activation" not in cfg:  # transformers' default
        kw["act"] = Activation.GELU_TANH
    return kw


GEMMA2 = Family(
    "gemma2",
    "Gemma2ForCausalLM",
    weights=LayerWeights(
        mlp_norm="pre_feedforward_layernorm.weight",
        attn_post_norm="post_attention_layernorm.weight",
        mlp_post_norm="post_feedforward_layernorm.weight",
    ),
    requires={
        "attention_bias": (False,),
        "use_bidirectional_attention": (None, False),
        "attention_dropout": (0, 0.0),  # training with dropout would differ from every step here
    },
    act_field="hidden_activation",
    features=_features,
)
