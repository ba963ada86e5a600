"""The LoRA training graph's mixture of experts (Mixtral): its forward, kept for the backward,
and its backward, for `workloads.llm.train`. The base weights are frozen (adapters on the
attention only), so the backward gives the gradient of the block's input: through each routed
expert's SwiGLU and through the router's choice.

Per GPU j (tensor-parallel as the forward: each GPU holds every expert's block of units):
- each expert's output gradient `moe_scale`(dy, route, n) = dy * route[:, n], then the SwiGLU
  backward to dx_n, conditional on the route's column n like the forward's expert vertices;
- the sum of the routed experts' dx_n (`moe_combine` weighted=false): GPU j's partial of dx;
- the route's gradient partial `moe_route_dot` (dy . out_n of GPU j's block);
on the tile's owner GPU w: the partials summed, `moe_route_grad` (the renormalised top-k
softmax's backward) to the router logits' gradient, times the router weight: added to dx once.
"""

from __future__ import annotations

from .moe_lora import expert_targets, experts_backward, experts_forward


def moe_forward(b, li: int, x2: list[str], stem: str, keep: dict) -> None:
    """Layer li's router and experts on every GPU's normed input x2[j]; `keep["moe"][j]` gets
    what the backward reads (`Layer.moe`)."""
    if expert_targets(b.cfg, b.lora.targets):  # adapters on the experts (workloads.llm.moe_lora)
        experts_forward(b, li, x2, stem, keep)
        return
    keep["moe"] = []
    for j in range(b.G):
        rec: dict = {}
        b.layer.moe(li, x2[j], j, stem, rec)
        keep["moe"].append(rec)


def moe_output(b, li: int, keep: dict, j: int, stem: str) -> str:
    """GPU j's partial of the mixture's output, from what `moe_forward` kept."""
    rec = keep["moe"][j]
    downs = [e["down"] for e in rec["experts"]]
    return b.g.kernel("moe_combine", rec["route"], *downs, id=f"{stem}.moe_g{j}")


def _experts_backward(b, li: int, keep: dict, dys: list[str], stem: str) -> tuple[list[str], list[str]]:
    """Per GPU: the experts' partial of dx and the route's gradient partial (no adapters on them)."""
    g = b.g
    dxs, dots = [], []
    for j in range(b.G):
        rec = keep["moe"][j]
        route, parts = rec["route"], []
        for n, e in enumerate(rec["experts"]):
            wt, s = b.layer.experts(li, j, n), f"{stem}.e{n}"
            dd = g.kernel("moe_scale", dys[j], route, id=f"{s}.dd_g{j}", index=n)
            dm = g.matmul(dd, wt["down"], id=f"{s}.dm_g{j}")
            da = g.mul(dm, e["up"], id=f"{s}.da_g{j}")
            dup = g.mul(dm, e["a"], id=f"{s}.dup_g{j}")
            dgt = g.kernel("silu_grad", e["gate"], da, id=f"{s}.dgate_g{j}")
            dxg = g.matmul(dgt, wt["gate"], id=f"{s}.dxg_g{j}")
            dxu = g.matmul(dup, wt["up"], id=f"{s}.dxu_g{j}")
            dx = g.add(dxg, dxu, id=f"{s}.dx_g{j}")
            for vid in (dd, dm, da, dup, dgt, dxg, dxu, dx):
                g.condition(vid, route, n)
            parts.append(dx)
        dxs.append(g.kernel("moe_combine", route, *parts, id=f"{stem}.mdx_g{j}", weighted=False))
        downs = [e["down"] for e in rec["experts"]]
        dots.append(g.kernel("moe_route_dot", dys[j], route, *downs, id=f"{stem}.mdr_g{j}"))
    return dxs, dots


def moe_backward(b, li: int, keep: dict, dys: list[str], w: int, stem: str) -> str:
    """The gradient of layer li's normed MLP input on owner GPU w, given dys[j], the gradient
    of the block's output on every GPU."""
    g, moe = b.g, b.cfg.spec.moe
    backward = experts_backward if expert_targets(b.cfg, b.lora.targets) else _experts_backward
    dxs, dots = backward(b, li, keep, dys, stem)
    dx = b.reduce(dxs, [], w, f"{stem}.mdx")
    droute = b.reduce(dots, [], w, f"{stem}.mdr")
    rec = keep["moe"][w]
    dlogits = g.kernel("moe_route_grad", rec["logits"], droute, id=f"{stem}.dlogits", top_k=moe.top_k)
    dxr = g.matmul(dlogits, b.layer_weights(li, w)["router"], id=f"{stem}.dxr")
    return g.add(dx, dxr, id=f"{stem}.dx2", gpu=w)
