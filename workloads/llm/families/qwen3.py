"""Qwen3 (`Qwen3ForCausalLM`): the shared layer with an RMSNorm on each head's queries and keys
(`q_norm`, `k_norm`: one weight [head_dim] each, epsilon rms_norm_eps), applied after the
projections and before the rotary embedding.

Refused: `attention_bias` true (biases on q, k, v and o; o's would need adding once after the
GPUs' partial sums) and sliding-window layers (as Qwen2's); `attention_dropout` as Qwen2's.
"""

from __future__ import annotations

from ..layer import LayerWeights
from .base import Family
from .qwen2 import features

QK_NORMED = LayerWeights(q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")

QWEN3 = Family(
    "qwen3",
    "Qwen3ForCausalLM",
    weights=QK_NORMED,
    requires={"attention_bias": (False,)},
    features=features,
)
