"""`Family`: what disco-ray knows of one model family, and nothing it does not.

A family is the config fields it reads (the shared ones in `families.config.common`, its own in
`features`), the values of other fields it requires (`requires`: a field that would change the
computation in a way not built is refused, never ignored), the activations it knows, and the
name and shape of every tensor its checkpoints hold (`tensors`). A checkpoint tensor that no
family tensor names is refused: a weight the model would not use means a different model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from disco_ray.graph.errors import UsageError

from ..layer import Activation, LayerWeights
from .config import ModelConfig, common

ACTIVATIONS = {"silu": Activation.SILU}  # config hidden_act -> the MLP's activation


def _no_features(cfg: dict, where: str) -> dict:
    return {}


@dataclass(frozen=True, slots=True)
class Family:
    """One model family (one `model_type`)."""

    model_type: str  # config.json "model_type"
    architecture: str  # the transformers class its checkpoints are saved from
    weights: LayerWeights = field(default_factory=LayerWeights)  # a layer's tensors by role
    # config fields that must hold one of these values when present: what the family's layer
    # does not do (a bias, another attention) is refused by name
    requires: Mapping[str, tuple] = field(default_factory=dict)
    act_field: str = "hidden_act"  # the config field naming the MLP's activation
    # the family's own config fields -> `ModelConfig` keyword arguments (and their checks)
    features: Callable[[dict, str], dict] = _no_features

    def parse(self, cfg: dict, where: str, gen: dict | None = None) -> ModelConfig:
        """config.json object `cfg` as a `ModelConfig`; UsageError naming `where` and the field."""
        for name, allowed in self.requires.items():
            if name in cfg and cfg[name] not in allowed:
                raise UsageError(
                    f"{where}: {name} {cfg[name]!r} is not supported for model_type "
                    f"{self.model_type!r} (supported: {', '.join(map(repr, allowed))})"
                )
        act = cfg.get(self.act_field, "silu")
        if act not in ACTIVATIONS:
            raise UsageError(
                f"{where}: {self.act_field} {act!r} is not supported (one of {', '.join(ACTIVATIONS)})"
            )
        kw = common(cfg, where, gen) | {
            "family": self.model_type,
            "act": ACTIVATIONS[act],
            "weights": self.weights,
        }
        return ModelConfig(**(kw | self.features(cfg, where)))

    def tensors(self, c: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of config `c` holds, with its shape."""
        want: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (c.vocab, c.dim),
            "model.norm.weight": (c.dim,),
        }
        if not c.tie:
            want["lm_head.weight"] = (c.vocab, c.dim)
        spec = c.spec
        for i in range(c.layers):
            want |= {f"model.layers.{i}.{name}": shape for name, shape in spec.tensors().items()}
        return want
