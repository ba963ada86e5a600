"""LoRA on a mixture's experts (Mixtral's w1, w3, w2) in the training graph, as peft trains them
on transformers' fused experts: per expert n, one adapter on gate_up (w1 and w3 fused: A [2r, dim]
shared by the gate and up rows, B [2 ffn, 2r], scaling 2 alpha / 2r = alpha / r) and one on down
(w2: A [r, ffn], B [dim, r]).

Split over the GPUs like the expert's weights: gate_up's A lives on the layer's owner GPU and is
sent to the others, its B rows by GPU (a part per gate and up, as a fused module's); down's A
columns by GPU, its B on the owner, which adds the adapter term to its partial of the expert's
output (so `moe_combine` weighs it by the route like the base term).

With adapters on the experts, every expert runs on every row (not conditional): an expert no row
chose gets route weight 0, so its adapters' gradients are exactly zero and AdamW still steps
them, as torch does for peft's one [experts * r, in] tensor whose unrouted rows get zero grad.
"""

from __future__ import annotations

from disco_ray.graph.errors import UsageError

from .layer import EXPERT_TARGETS
from .lora import Param


def expert_targets(cfg, targets: tuple[str, ...]) -> bool:
    """Whether `targets` put adapters on the experts of `cfg` (a mixture); UsageError unless
    they name all of w1, w2, w3 or none (peft fuses w1 and w3; disco-ray trains the three)."""
    got = [t for t in EXPERT_TARGETS if t in targets]
    if cfg.spec.moe is None or not got:
        return False
    if len(got) < len(EXPERT_TARGETS):
        raise UsageError(
            f"finetune: LoRA target(s) {', '.join(got)} of model_type {cfg.family!r}: the experts take "
            f"adapters on all of {', '.join(EXPERT_TARGETS)} or none"
        )
    return True


def key_module(n: int, mod: str) -> str:
    """The module name (`Param.module`) of expert n's adapter `mod` ("gate_up" or "down")."""
    return f"experts.{n}.{mod}"


def _state(b, li: int, n: int, mod: str, which: str, part: str, j: int) -> str:
    """The state input of one block of expert n's adapter (made on first use), like
    `LoraLayers.state`: `part` names gate_up's B rows ("gate" or "up"), else ""."""
    sid = f"lora.l{li}.e{n}.{mod}.{which}{'.' + part if part else ''}_g{j}"
    if sid in b.g:
        return sid
    ffn, dim, hd = b.cfg.spec.whole("gate")[0], b.cfg.dim, b.cfg.head_dim
    r = b.lora.rank * (2 if mod == "gate_up" else 1)
    if mod == "gate_up":
        full = (r, dim) if which == "A" else (2 * ffn, r)
        if which == "A":
            rows, cols = (0, r), (0, dim)
        else:
            lo, hi = b.split.shard(part, j, hd)
            at = 0 if part == "gate" else ffn
            rows, cols = (at + lo, at + hi), (0, r)
    else:
        full = (r, ffn) if which == "A" else (dim, r)
        rows, cols = ((0, r), b.split.shard("down", j, hd)) if which == "A" else ((0, dim), (0, r))
    p = Param(sid, j, li, key_module(n, mod), which, rows, cols, full)
    b.params.append(p)
    b.g.input(sid, (b.optim.slots * p.shape[0], p.shape[1]), b.dtype, gpu=j, state=True)
    b.grads[sid] = []
    return sid


def experts_forward(b, li: int, x2: list[str], stem: str, keep: dict) -> None:
    """Layer li's router and experts with adapters on every GPU's normed input x2[j]: fills
    `keep["moe"][j]` as `Layer.moe` does (+ per expert its mul "m" and gate_up's "u" = x A^T)
    and `keep["moe_ud"][n]`, down's x A^T summed on the owner."""
    g, moe, s, o = b.g, b.cfg.spec.moe, b.lora.scaling, b.owner(li)
    keep["moe"], keep["moe_ud"] = [], []
    uds: list[list[str]] = [[] for _ in range(moe.experts)]
    for j in range(b.G):
        x = x2[j]
        logits = g.linear(x, b.layer.weights(li, j)["router"], id=f"{stem}.router_g{j}")
        route = g.kernel("moe_route", logits, id=f"{stem}.route_g{j}", top_k=moe.top_k)
        kept = []
        for n in range(moe.experts):
            w, e = b.layer.experts(li, j, n), f"{stem}.e{n}"
            a_id = b.param(_state(b, li, n, "gate_up", "A", "", o), j)
            u = g.linear(x, a_id, id=f"{e}.u_g{j}")
            gu = {}
            for part in ("gate", "up"):
                base = g.linear(x, w[part], id=f"{e}.{part}0_g{j}")
                bp = b.param(_state(b, li, n, "gate_up", "B", part, j), j)
                lo = g.linear(u, bp, id=f"{e}.{part}l_g{j}", scale=s)
                gu[part] = g.add(base, lo, id=f"{e}.{part}_g{j}")
            a = b.layer.act(gu["gate"], f"{e}.act_g{j}")
            m = g.mul(a, gu["up"], id=f"{e}.mul_g{j}")
            down = g.linear(m, w["down"], id=f"{e}.down0_g{j}")
            ud = g.linear(m, b.param(_state(b, li, n, "down", "A", "", j), j), id=f"{e}.ud_g{j}")
            uds[n].append(ud if j == o else g.transfer(ud, o, id=f"{e}.ud_p{j}"))
            kept.append({"gate": gu["gate"], "a": a, "up": gu["up"], "m": m, "u": u, "down": down})
        keep["moe"].append({"logits": logits, "route": route, "experts": kept})
    for n in range(moe.experts):  # down's adapter term, on the owner's partial of the output
        e = f"{stem}.e{n}"
        ud = uds[n][0] if b.G == 1 else g.add(*uds[n], id=f"{e}.ud", gpu=o)
        keep["moe_ud"].append(ud)
        bd = b.param(_state(b, li, n, "down", "B", "", o), o)
        rec = keep["moe"][o]["experts"][n]
        rec["down"] = g.add(rec["down"], g.linear(ud, bd, id=f"{e}.dl", scale=s), id=f"{e}.down_g{o}")


def experts_backward(b, li: int, keep: dict, dys: list[str], stem: str) -> tuple[list[str], list[str]]:
    """Per GPU: the experts' partial of dx (summed over routed experts) and the route's gradient
    partial; the adapters' gradients recorded (`LoraLayers.grad`)."""
    g, moe, s, o = b.g, b.cfg.spec.moe, b.lora.scaling, b.owner(li)
    dds = [[""] * moe.experts for _ in range(b.G)]
    dms = [[""] * moe.experts for _ in range(b.G)]
    for n in range(moe.experts):
        e = f"{stem}.e{n}"
        for j in range(b.G):
            wt = b.layer.experts(li, j, n)
            dds[j][n] = g.kernel("moe_scale", dys[j], keep["moe"][j]["route"], id=f"{e}.dd_g{j}", index=n)
            dms[j][n] = g.matmul(dds[j][n], wt["down"], id=f"{e}.dm0_g{j}")
        sb = _state(b, li, n, "down", "B", "", o)
        ud = keep["moe_ud"][n]
        b.grad(sb, g.kernel("linear_grad_w", dds[o][n], ud, id=f"{e}.gBd", scale=s), o, f"{e}.gBd")
        du0 = g.matmul(dds[o][n], b.param(sb, o), id=f"{e}.dud0")
        dus = b.layer.broadcast(g.scale(du0, s, id=f"{e}.dud"), f"{e}.dudb")
        for j in range(b.G):
            sa = _state(b, li, n, "down", "A", "", j)
            m = keep["moe"][j]["experts"][n]["m"]
            b.grad(sa, g.kernel("linear_grad_w", dus[j], m, id=f"{e}.gAd_g{j}"), j, f"{e}.gAd_g{j}")
            dl = g.matmul(dus[j], b.param(sa, j), id=f"{e}.dml_g{j}")
            dms[j][n] = g.add(dms[j][n], dl, id=f"{e}.dm_g{j}")
    dxs, dots = [], []
    for j in range(b.G):
        rec, parts = keep["moe"][j], []
        for n, ex in enumerate(rec["experts"]):
            parts.append(_gate_up_backward(b, li, n, j, ex, dms[j][n], keep["x2"][j], f"{stem}.e{n}", s, o))
        dxs.append(g.kernel("moe_combine", rec["route"], *parts, id=f"{stem}.mdx_g{j}", weighted=False))
        downs = [ex["down"] for ex in rec["experts"]]
        dots.append(g.kernel("moe_route_dot", dys[j], rec["route"], *downs, id=f"{stem}.mdr_g{j}"))
    return dxs, dots


def _gate_up_backward(b, li, n, j, ex: dict, dm: str, x: str, e: str, s: float, o: int) -> str:
    """Expert n's SwiGLU and gate_up backward on GPU j from dm (the gradient of its mul): its dx
    partial; gate_up's adapter gradients recorded."""
    g, wt = b.g, b.layer.experts(li, j, n)
    da = g.mul(dm, ex["up"], id=f"{e}.da_g{j}")
    dup = g.mul(dm, ex["a"], id=f"{e}.dup_g{j}")
    dgt = g.kernel(b.cfg.act.grad, ex["gate"], da, id=f"{e}.dgate_g{j}")
    dx = g.add(
        g.matmul(dgt, wt["gate"], id=f"{e}.dxg_g{j}"),
        g.matmul(dup, wt["up"], id=f"{e}.dxu_g{j}"),
        id=f"{e}.dxb_g{j}",
    )
    dus = []
    for part, dy in (("gate", dgt), ("up", dup)):
        sb = _state(b, li, n, "gate_up", "B", part, j)
        gid = f"{e}.gB{part}_g{j}"
        b.grad(sb, g.kernel("linear_grad_w", dy, ex["u"], id=gid, scale=s), j, gid)
        dus.append(g.matmul(dy, b.param(sb, j), id=f"{e}.du{part}_g{j}"))
    du = g.scale(g.add(*dus, id=f"{e}.du0_g{j}"), s, id=f"{e}.du_g{j}")
    sa = _state(b, li, n, "gate_up", "A", "", o)
    b.grad(sa, g.kernel("linear_grad_w", du, x, id=f"{e}.gA_g{j}"), j, f"{e}.gA_g{j}")
    return g.add(dx, g.matmul(du, b.param(sa, j), id=f"{e}.dxl_g{j}"), id=f"{e}.dx_g{j}")
