"""Phi-3 (`Phi3ForCausalLM`): LLaMA's layer with fused projections.

A checkpoint holds `self_attn.qkv_proj.weight` ([q + 2 kv, dim]: the query rows, then the key
rows, then the value rows) and `mlp.gate_up_proj.weight` ([2 ffn, dim]: gate rows, then up
rows). Each role names the fused tensor, so the layer builder reads each GPU's rows of q, k, v,
gate and up as separate blocks of it (`LayerSpec.offset`) and computes them as for LLaMA; LoRA
adapts the fused modules as PEFT does (one A, B's rows split into the parts, `workloads.llm.lora`).

`sliding_window` (Phi-3 mini sets 2047) masks keys more than the window behind a query in every
layer, as Mistral's does (`mistral.windows`: the same windowed attention ops). Only the default rotary embedding is built ("longrope", "su":
refused by name). `original_max_position_embeddings` only matters to longrope. The dropout fields
change nothing at inference; training, which has no dropout, refuses them above 0.
"""

from __future__ import annotations

from disco_ray.graph.errors import UsageError

from ..layer import LayerWeights
from .base import Family
from .config import read
from .mistral import windows

DROPOUTS = ("resid_pdrop", "embd_pdrop", "attention_dropout")


def _features(cfg: dict, where: str) -> dict:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype != "default":  # transformers' Phi-3 knows default and longrope only
        raise UsageError(
            f"{where}: rope_scaling type {rtype!r} is not supported for model_type 'phi3' (only default)"
        )
    dropout = []
    for name in DROPOUTS:
        p = read(cfg, where, name, (int, float), 0.0, positive=False)
        if not 0 <= p < 1:
            raise UsageError(f"{where}: {name!r} must be in [0, 1), got {p!r}")
        if p:
            dropout.append((name, float(p)))
    return {**windows(cfg, where), "dropout": tuple(dropout)}


PHI3 = Family(
    "phi3",
    "Phi3ForCausalLM",
    weights=LayerWeights(
        q="self_attn.qkv_proj.weight",
        k="self_attn.qkv_proj.weight",
        v="self_attn.qkv_proj.weight",
        gate="mlp.gate_up_proj.weight",
        up="mlp.gate_up_proj.weight",
    ),
    features=_features,
)
