"""Mistral (`MistralForCausalLM`): LLaMA's layer with sliding-window attention.

`sliding_window` w (null: full attention) lets a query at position p see only the keys in
(p - w, p], as transformers' `sliding_window_overlay`; every layer has the same window. The
graphs read only the KV cache blocks and key tiles that reach into the window
(`LayerSpec.first_key`).
"""

from __future__ import annotations

from .base import Family
from .config import read


def windows(cfg: dict, where: str) -> dict:
    """`sliding_window` (a positive integer, or null) as every layer's window."""
    w = read(cfg, where, "sliding_window", default=None)
    if w is None:
        return {}
    return {"windows": (w,) * read(cfg, where, "num_hidden_layers")}


MISTRAL = Family(
    "mistral",
    "MistralForCausalLM",
    requires={"attention_bias": (False,), "mlp_bias": (False,)},
    features=windows,
)
