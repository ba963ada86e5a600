"""LoRA adapters in PEFT's layout: `adapter_config.json` + `adapter_model.safetensors`.

Keys are those `peft.PeftModel.save_pretrained` writes for a LLaMA, e.g.
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]), so `peft.PeftModel.from_pretrained(base, DIR)` loads what `save` writes, and `load`
reads what PEFT saved. Only what disco-ray trains is accepted: plain LoRA (no DoRA, no bias, no
dropout, no per-layer rank or alpha patterns but the one peft gives Mixtral's fused experts:
`adapter_experts`) on the linear layers of the decoder. An adapter
holding NaN or infinity is neither read nor written (refused naming the tensor).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from disco_ray.graph.errors import NonFiniteError, UsageError
from disco_ray.graph.files import new_directory, write_bytes
from workloads.llm.layer import EXPERT_TARGETS
from workloads.llm.train import TARGETS, LoraSpec

from . import adapter_experts as ex

PREFIX = "base_model.model.model.layers."
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def key(layer: int, module: str, which: str) -> str:
    """PEFT's key of adapter matrix `which` ("A" or "B") of `module` in decoder layer `layer`."""
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp"
    return f"{PREFIX}{layer}.{block}.{module}.lora_{which}.weight"


def init(
    spec: LoraSpec, layers: int, dims: dict[str, tuple[int, int]], seed: int = 0, experts: int = 0
) -> dict[str, torch.Tensor]:
    """A fresh adapter as PEFT makes one: A ~ kaiming-uniform(a=sqrt(5)) (bound 1/sqrt(in)), B = 0.

    `dims[module]` is the module's (out, in); `experts`: a mixture's (its expert adapters keyed
    per expert, `adapter_experts`).
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for li in range(layers):
        for m in spec.targets:
            if m in EXPERT_TARGETS:
                continue
            o, i = dims[m]
            bound = 1.0 / math.sqrt(i)
            out[key(li, m, "A")] = (torch.rand(spec.rank, i, generator=gen) * 2 - 1) * bound
            out[key(li, m, "B")] = torch.zeros(o, spec.rank)
        if experts and EXPERT_TARGETS[0] in spec.targets:
            for n in range(experts):
                for mod in ex.PARTS:
                    a, b = ex.dims(mod, spec.rank, *dims["w1"])
                    bound = 1.0 / math.sqrt(a[1])
                    out[ex.ours(li, n, mod, "A")] = (torch.rand(a, generator=gen) * 2 - 1) * bound
                    out[ex.ours(li, n, mod, "B")] = torch.zeros(b)
    return out


def load(
    path: str | Path, layers: int, dims: dict[str, tuple[int, int]], experts: int = 0
) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """(spec, tensors by PEFT key) of the adapter directory `path`; UsageError naming the field or key."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path = path / CONFIG
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{cfg_path}: missing (an adapter directory has adapter_config.json)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{cfg_path}: cannot read it as JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{cfg_path}: want a JSON object")
    on_experts = ex.check_config(cfg, str(cfg_path))  # peft's patterns for Mixtral's experts
    if on_experts and not experts:
        raise UsageError(
            f"{cfg_path}: target_parameters {cfg['target_parameters']!r}: the model has no experts"
        )
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UsageError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for field, ok in (
        ("lora_dropout", lambda x: not x),
        ("bias", lambda x: x in (None, "none")),
        ("use_dora", lambda x: not x),
        ("fan_in_fan_out", lambda x: not x),
        ("rank_pattern", lambda x: on_experts or not x),
        ("alpha_pattern", lambda x: on_experts or not x),
        ("layers_to_transform", lambda x: x is None),
        ("modules_to_save", lambda x: not x),
    ):
        if field in cfg and not ok(cfg[field]):
            raise UsageError(
                f"{cfg_path}: {field} {cfg[field]!r} is not supported by disco-ray's LoRA training"
            )
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list):
        raise UsageError(f"{cfg_path}: target_modules must be a list of module names, got {targets!r}")
    spec = LoraSpec(
        rank=cfg.get("r", 8),
        alpha=cfg.get("lora_alpha", 8),
        targets=tuple(m for m in TARGETS if m in targets or (on_experts and m in EXPERT_TARGETS)),
        rslora=bool(cfg.get("use_rslora", False)),
    )
    unknown = sorted(set(targets) - set(dims))
    if unknown:  # `dims`: the model's modules
        raise UsageError(f"{cfg_path}: target_modules {unknown} are not among {', '.join(dims)}")
    spec.check()
    try:
        raw = load_file(str(path / WEIGHTS))
    except FileNotFoundError:
        raise UsageError(f"{path / WEIGHTS}: missing") from None
    except (OSError, SafetensorError) as e:
        raise UsageError(f"{path / WEIGHTS}: not a readable safetensors file ({e})") from None
    tensors = {k.replace(".default.weight", ".weight"): v for k, v in raw.items()}
    out = {}
    for li in range(layers):
        for m in _modules(spec, experts):
            for which, shape in _shapes(spec, m, dims, experts):
                k = key(li, m, which) if m not in ex.PARTS else ex.peft_key(li, m, which)
                if k not in tensors:
                    raise UsageError(f"{path / WEIGHTS}: no tensor {k!r}")
                if tuple(tensors[k].shape) != shape:
                    raise UsageError(
                        f"{path / WEIGHTS}: {k!r} has shape {list(tensors[k].shape)}, want {list(shape)}"
                    )
                if not tensors[k].is_floating_point():
                    raise UsageError(f"{path / WEIGHTS}: {k!r} has dtype {tensors[k].dtype}, want a float")
                out[k] = tensors[k].float()
                bad = _not_finite(out[k])
                if bad:
                    raise UsageError(f"{path / WEIGHTS}: {k!r} holds {bad}: training would compute NaN")
    return spec, ex.split(out, layers, experts) if on_experts else out


def _modules(spec: LoraSpec, experts: int) -> list[str]:
    """The modules whose tensors an adapter file holds: peft's fused experts' for w1, w2, w3."""
    mods = [m for m in spec.targets if m not in EXPERT_TARGETS]
    return mods + list(ex.PARTS) if experts and EXPERT_TARGETS[0] in spec.targets else mods


def _shapes(spec: LoraSpec, m: str, dims: dict, experts: int) -> list[tuple[str, tuple[int, int]]]:
    """(which, shape) of module m's A and B as saved (an expert module's: all experts fused)."""
    if m not in ex.PARTS:
        o, i = dims[m]
        return [("A", (spec.rank, i)), ("B", (o, spec.rank))]
    (ra, ia), (ob, rb) = ex.dims(m, spec.rank, *dims["w1"])
    return [("A", (experts * ra, ia)), ("B", (ob, rb * experts))]


def _not_finite(t: torch.Tensor) -> str:
    """'' when every value of `t` is finite, else how many are NaN and infinite."""
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return f"{nan} NaN and {inf} infinite values of {t.numel()}" if nan or inf else ""


def save(path: str | Path, spec: LoraSpec, tensors: dict[str, torch.Tensor], base: str) -> None:
    """Writes the adapter directory (the files appear whole: written aside, then renamed).

    Raises:
        NonFiniteError: a tensor holds NaN or infinity (named); nothing is written.
    """
    from safetensors.torch import save as serialize

    for k, t in tensors.items():
        bad = _not_finite(t)
        if bad:
            raise NonFiniteError(f"{path}: not written: adapter tensor {k!r} holds {bad}")
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": [t for t in spec.targets if t not in EXPERT_TARGETS],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": spec.rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        **(ex.config(spec.rank, spec.alpha) if EXPERT_TARGETS[0] in spec.targets else {}),
    }
    with new_directory(path) as into:  # a failure leaves the previous adapter, or no directory
        # bytes written here: a full disk is an OSError naming the file (safetensors' own
        # writer raises its SafetensorError)
        write_bytes(into / WEIGHTS, serialize({k: v.contiguous() for k, v in tensors.items()}))
        write_bytes(into / CONFIG, json.dumps(cfg, indent=2).encode())
