"""Mixtral (`MixtralForCausalLM`): the shared layer with a sparse mixture of experts instead of
the MLP (a router picks `num_experts_per_tok` of `num_local_experts` SwiGLU experts per token).

Each expert's weights are conditional vertices: a step loads and runs only the experts some
token chose (docs/FORMATS.md, "Conditional vertices"). Sliding-window attention and router
jitter are refused (`requires`).
"""

from __future__ import annotations

from dataclasses import dataclass

from disco_ray.graph.errors import UsageError

from ..layer import LayerWeights, MoeSpec
from .base import Family
from .config import ModelConfig, read

EXPERTS = "block_sparse_moe.experts.{n}."


def _features(cfg: dict, where: str) -> dict:
    experts = read(cfg, where, "num_local_experts", default=8)
    top_k = read(cfg, where, "num_experts_per_tok", default=2)
    if top_k > experts:
        raise UsageError(f"{where}: num_experts_per_tok {top_k} exceeds num_local_experts {experts}")
    return {"moe": MoeSpec(experts, top_k)}


@dataclass(frozen=True, slots=True)
class MoeFamily(Family):
    """A family whose MLP is a mixture: its expert tensors, named with {n}, once per expert."""

    def tensors(self, c: ModelConfig) -> dict[str, tuple[int, ...]]:
        want = Family.tensors(self, c)
        moe = c.spec.moe
        if moe is None:
            return want
        out: dict[str, tuple[int, ...]] = {}
        for name, shape in want.items():
            if "{n}" not in name:
                out[name] = shape
                continue
            out |= {name.format(n=n): shape for n in range(moe.experts)}
        for i in range(c.layers):
            out[f"model.layers.{i}.{moe.router}"] = (moe.experts, c.dim)
        return out


MIXTRAL = MoeFamily(
    "mixtral",
    "MixtralForCausalLM",
    weights=LayerWeights(gate=EXPERTS + "w1.weight", up=EXPERTS + "w3.weight", down=EXPERTS + "w2.weight"),
    requires={"sliding_window": (None,), "router_jitter_noise": (0, 0.0)},
    features=_features,
)
