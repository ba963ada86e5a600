"""Qwen2 (`Qwen2ForCausalLM`): the shared layer with biases on the q, k and v projections (each
GPU reads its rows of a bias, as of its projection); tied embeddings in the small models.

Sliding-window attention (`use_sliding_window` with `max_window_layers`, or `layer_types`) is
refused: every layer must attend to the whole sequence. `attention_dropout` changes nothing at
inference; training, which has no dropout, refuses it above 0.
"""

from __future__ import annotations

from disco_ray.graph.errors import UsageError

from ..layer import LayerWeights
from .base import Family
from .config import read

BIASED = LayerWeights(
    q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias", v_bias="self_attn.v_proj.bias"
)


def features(cfg: dict, where: str) -> dict:
    """The `ModelConfig` fields of a Qwen2 or Qwen3 config.json: a nonzero `attention_dropout`
    (refused by training); a sliding-window layer refused (`full_attention_only`)."""
    full_attention_only(cfg, where)
    p = read(cfg, where, "attention_dropout", (int, float), 0.0, positive=False)
    if not 0 <= p < 1:
        raise UsageError(f"{where}: 'attention_dropout' must be in [0, 1), got {p!r}")
    return {"dropout": (("attention_dropout", float(p)),) if p else ()}


def full_attention_only(cfg: dict, where: str) -> None:
    """Refuses (naming the field) a config with a sliding-window layer, as transformers decides
    it: `layer_types` when given, else `use_sliding_window` with a `sliding_window` for the
    layers from `max_window_layers` on."""
    mt = cfg.get("model_type")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise UsageError(f"{where}: layer_types must be a list, got {types!r}")
        for i, t in enumerate(types):
            if t != "full_attention":
                raise UsageError(
                    f"{where}: layer_types[{i}] {t!r} is not supported for model_type {mt!r} (only "
                    "'full_attention': sliding-window attention is not implemented)"
                )
        return
    layers, first = cfg.get("num_hidden_layers"), cfg.get("max_window_layers", 28)
    sliding = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
    if sliding and isinstance(layers, int) and isinstance(first, int) and first < layers:
        raise UsageError(
            f"{where}: use_sliding_window true (max_window_layers {first} < num_hidden_layers {layers}) "
            f"is not supported for model_type {mt!r}: sliding-window attention is not implemented"
        )


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", weights=BIASED, features=features)
