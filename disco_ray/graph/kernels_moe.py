"""Torch implementations of the mixture-of-experts ops (`ops_moe`), as transformers' Mixtral
computes them (`MixtralTopKRouter`, `MixtralExperts`). Like `kernels_llm`, this module imports
nothing of the project."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
KERNELS: dict[str, Impl] = {}


def routed(route: torch.Tensor) -> list[bool]:
    """Per expert: whether some row of `route` (moe_route's output) chose it."""
    return (route != 0).any(dim=0).tolist()


def _route(out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
    probs = torch.softmax(ins[0].float(), dim=-1)
    top, idx = torch.topk(probs, attrs["top_k"], dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    out.zero_().scatter_(-1, idx, top)


def _combine(out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
    route, parts = ins[0], ins[1:]
    out.zero_()
    for n, on in enumerate(routed(route)):
        if not on:  # an expert no row chose was skipped: its output range holds no number
            continue
        if not attrs.get("weighted", True):
            out.add_(parts[n])
            continue
        w = route[:, n : n + 1]
        # transformers: (out_n * weight) in float32, cast, added; rows not chosen add exactly 0
        out.add_(torch.where(w != 0, parts[n].float() * w, 0.0).to(out.dtype))


def _route_grad(out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
    logits, droute = ins
    p = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.topk(p, attrs["top_k"], dim=-1)
    z = top.sum(dim=-1, keepdim=True)
    g = droute.gather(-1, idx)
    # w_i = p_i / z over the chosen: dL/dp_k = (g_k - sum_i g_i w_i) / z for chosen k, else 0
    dp = torch.zeros_like(p).scatter_(-1, idx, (g - (g * top / z).sum(-1, keepdim=True)) / z)
    out.copy_(p * (dp - (p * dp).sum(-1, keepdim=True)))  # softmax's backward


def _route_dot(out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
    dy, route, parts = ins[0].float(), ins[1], ins[2:]
    out.zero_()
    for n, on in enumerate(routed(route)):
        if on:
            out[:, n] = torch.where(route[:, n] != 0, (dy * parts[n].float()).sum(-1), 0.0)


def _scale(out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
    dy, route = ins
    out.copy_((dy.float() * route[:, attrs["index"]].unsqueeze(-1)).to(out.dtype))


KERNELS["moe_route"] = _route
KERNELS["moe_combine"] = _combine
KERNELS["moe_route_grad"] = _route_grad
KERNELS["moe_route_dot"] = _route_dot
KERNELS["moe_scale"] = _scale
