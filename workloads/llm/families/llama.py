"""LLaMA (`LlamaForCausalLM`): the shared layer as it is, no biases, SiLU MLP."""

from __future__ import annotations

from .base import Family

LLAMA = Family(
    "llama",
    "LlamaForCausalLM",
    requires={"attention_bias": (False,), "mlp_bias": (False,)},
)
