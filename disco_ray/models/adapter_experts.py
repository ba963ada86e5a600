"""A mixture's expert adapters (Mixtral's w1, w3, w2) between peft's layout and disco-ray's.

peft (0.21, on transformers 5's fused experts) saves one pair per layer and fused parameter:
`mlp.experts.base_layer.lora_{A,B}` for gate_up (w1 and w3: rank 2r, alpha 2 alpha; A [E 2r, dim]
with expert n's A in rows n 2r.., B [2 ffn, 2r E] with expert n's B in columns r' E + n) and
`mlp.experts.lora_{A,B}` for down (w2: A [E r, ffn], B [dim, r E]); its config lists them as
`target_parameters` ["gate_up_proj", "down_proj"] with a rank and alpha pattern for gate_up.
disco-ray trains expert n's matrices as modules `experts.{n}.gate_up` and `experts.{n}.down`
(`workloads.llm.moe_lora`), keyed like any module (`adapter.key`).
"""

from __future__ import annotations

import torch

from disco_ray.graph.errors import UsageError

PARTS = {"gate_up": "mlp.experts.base_layer", "down": "mlp.experts"}  # ours -> peft's block
PREFIX = "base_model.model.model.layers."


def peft_key(layer: int, mod: str, which: str) -> str:
    return f"{PREFIX}{layer}.{PARTS[mod]}.lora_{which}.weight"


def ours(layer: int, n: int, mod: str, which: str) -> str:
    return f"{PREFIX}{layer}.mlp.experts.{n}.{mod}.lora_{which}.weight"


def config(rank: int, alpha: float) -> dict:
    """The adapter_config.json fields peft writes for expert adapters (besides target_modules)."""
    pat = r".*\.gate_up_proj"
    return {
        "target_parameters": ["gate_up_proj", "down_proj"],
        "rank_pattern": {pat: 2 * rank},
        "alpha_pattern": {pat: 2 * alpha},
    }


def check_config(cfg: dict, where: str) -> bool:
    """Whether config `cfg` (of file `where`) adapts the experts as peft does; UsageError for
    another parameter target or pattern."""
    params = cfg.get("target_parameters") or []
    if not params and not cfg.get("rank_pattern") and not cfg.get("alpha_pattern"):
        return False
    want = config(cfg.get("r", 8), cfg.get("lora_alpha", 8))
    for field, value in want.items():
        got = sorted(params) if field == "target_parameters" else cfg.get(field)
        if got != (sorted(value) if field == "target_parameters" else value):
            raise UsageError(
                f"{where}: {field} {cfg.get(field)!r} is not supported (want {value!r}: Mixtral's experts)"
            )
    return True


def dims(mod: str, rank: int, ffn: int, dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(A's, B's) shape of one expert's adapter `mod`."""
    if mod == "gate_up":
        return (2 * rank, dim), (2 * ffn, 2 * rank)
    return (rank, ffn), (dim, rank)


def split(tensors: dict[str, torch.Tensor], layers: int, experts: int) -> dict[str, torch.Tensor]:
    """peft's fused expert tensors -> per expert matrices (ours); the other tensors as they are."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for li in range(layers):
        for mod in PARTS:
            a, b = tensors[peft_key(li, mod, "A")], tensors[peft_key(li, mod, "B")]
            a3 = a.reshape(experts, -1, a.shape[-1])
            b3 = b.reshape(b.shape[0], -1, experts)
            for n in range(experts):
                out[ours(li, n, mod, "A")] = a3[n].clone()
                out[ours(li, n, mod, "B")] = b3[:, :, n].clone()
    return out


def fuse(tensors: dict[str, torch.Tensor], layers: int, experts: int) -> dict[str, torch.Tensor]:
    """The inverse of `split`: per expert matrices -> peft's fused tensors."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for li in range(layers):
        for mod in PARTS:
            a = [tensors[ours(li, n, mod, "A")] for n in range(experts)]
            b = [tensors[ours(li, n, mod, "B")] for n in range(experts)]
            out[peft_key(li, mod, "A")] = torch.cat(a)
            out[peft_key(li, mod, "B")] = torch.stack(b, dim=2).reshape(b[0].shape[0], -1)
    return out
