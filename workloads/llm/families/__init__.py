"""The model families disco-ray runs, one module each, and the registry that picks one by a
config.json's `model_type`.

Adding a family (docs/MODELS.md, "Adding a model family"): a module here with its `Family` (the
config fields it reads, the values it requires, its tensors), what its layer adds to the shared
layer (`workloads.llm.layer`), its entry in `FAMILIES`, and its tests against its transformers
class (tests/test_families.py).
"""

from __future__ import annotations

from disco_ray.graph.errors import UsageError

from .base import Family
from .config import ModelConfig
from .gemma2 import GEMMA2
from .llama import LLAMA
from .mistral import MISTRAL
from .mixtral import MIXTRAL
from .phi3 import PHI3
from .qwen2 import QWEN2
from .qwen3 import QWEN3

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        LLAMA,
        MISTRAL,
        PHI3,
        GEMMA2,
        QWEN2,
        QWEN3,
        MIXTRAL,
    )
}

__all__ = ["FAMILIES", "Family", "ModelConfig", "family_of", "parse_config"]


def family_of(cfg: dict, where: str) -> Family:
    """The family of config.json object `cfg` (at `where`), by its model_type."""
    mt = cfg.get("model_type")
    fam = FAMILIES.get(mt) if isinstance(mt, str) else None
    if fam is None:
        known = ", ".join(f"{f.model_type!r} ({f.architecture})" for f in FAMILIES.values())
        raise UsageError(
            f"{where}: model_type {mt!r} (architectures {cfg.get('architectures')}) is not supported; "
            f"supported: {known}"
        )
    return fam


def parse_config(cfg: dict, where: str, gen: dict | None = None) -> ModelConfig:
    """config.json object `cfg` (at `where`; `gen`: generation_config.json's) read by its
    family; UsageError naming `where` and the field for what is unsupported."""
    return family_of(cfg, where).parse(cfg, where, gen)
