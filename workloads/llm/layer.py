"""The tensor-parallel decoder layer of LLaMA-style models, built once for every graph that has one.

A layer (Touvron et al., 2023): RMSNorm, Q/K/V projections, rotary embedding, causal
(grouped-query) attention, output projection, residual add, RMSNorm, gated MLP, residual add.
Split over G GPUs Megatron-style (Shoeybi et al., 2019): each GPU holds heads/G query heads, its
key/value heads and ffn/G MLP units, computes partial output and down projections, which the row
tile's owner GPU sums with the residual and sends back to every GPU (`Layer.all_reduce`).

`LayerSpec` (in `layer_spec`, with `Split` and the rotary tables) describes a layer: its sizes, norm epsilon, rotary embedding, attention scale,
activation and the name of each weight (optional ones too: the q/k/v projections' biases, the
per-head RMSNorm of queries and keys). A model family is a `LayerSpec` (from its config.json)
plus what its layer adds; `Layer` adds a layer's vertices to a TaskGraph, and is what the
synthetic workload (`workloads.llama`) and the checkpoint models (`workloads.llm.model`,
`workloads.llm.train`) build their layers with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from disco_ray.graph.taskgraph import TaskGraph

from .layer_spec import (
    BIASES,
    COL_SPLIT,
    EXPERT_ROLES,
    EXPERT_TARGETS,
    ROLES,
    ROW_SPLIT,
    Activation,
    LayerSpec,
    LayerWeights,
    Layout,
    MoeSpec,
    Order,
    Split,
    rope_tables,
)
from .packed import dequantized, fused, qlinear

# the layer's description lives in `layer_spec`; these names are read from here by the builders
__all__ = [
    "BIASES",
    "COL_SPLIT",
    "EXPERT_ROLES",
    "EXPERT_TARGETS",
    "ROLES",
    "ROW_SPLIT",
    "Activation",
    "Attend",
    "Layer",
    "LayerSpec",
    "LayerWeights",
    "Layout",
    "MoeSpec",
    "Order",
    "Split",
    "rope_tables",
]


# attend(j, q, k, v) -> GPU j's attention output ("" when q is not needed): the caller's part of
# the attention block, where it keeps keys and values (tiles, a KV cache) as its graph needs
Attend = Callable[[int, str, str, str], str]


class Layer:
    """Adds decoder layers described by `spec`, split by `split`, to TaskGraph `g`.

    `weights(li, j)` gives the input ids of layer li's weights on GPU j by role (`ROLES`); the
    caller makes them (random inputs, checkpoint sources). Vertex ids stem from the `stem` each
    method is given: `{stem}.norm1_g{j}`, `{stem}.q_g{j}`, `{stem}.h1`, ...
    """

    def __init__(
        self, g: TaskGraph, spec: LayerSpec, split: Split, weights: Callable[[int, int], Mapping[str, str]]
    ):
        self.g, self.spec, self.split, self.weights = g, spec, split, weights
        self.G = g.gpus
        # a mixture's expert weights: experts(li, j, n) -> expert n's input ids by role (gate/up/down)
        self.experts: Callable[[int, int, int], Mapping[str, str]] | None = None

    # ---- one step on one GPU -----------------------------------------------------------------
    def norm(self, li: int, role: str, x: str, j: int, id: str) -> str:
        return self.g.rmsnorm(x, self.weights(li, j)[role], id=id, **self.norm_attrs())

    def norm_attrs(self) -> dict:
        """The attributes of every RMSNorm (and its backward): eps, and the weight's offset if any."""
        off = self.spec.norm_offset
        return {"eps": self.spec.eps, **({"offset": off} if off else {})}

    def project(self, li: int, role: str, x: str, j: int, id: str) -> str:
        """x times GPU j's block of projection `role` (plus its bias, when the layer has one)."""
        ws = self.weights(li, j)
        w, b = ws[role], ws.get(f"{role}_bias")
        if self.g[w].dtype == "uint8":  # packed (a quantized checkpoint): dequantized just before use
            cols = self.split.block_shape(self.spec, role, j)[1]
            if self.spec.layout is not Layout.IN_OUT and fused(self.g, w):  # no float copy of w
                y = qlinear(self.g, x, w, cols, id)
                return y if b is None else self.g.add(y, b, id=f"{id}.b")
            w = dequantized(self.g, w, cols, self.g[x].dtype, f"{id}.w")
        if self.spec.layout is Layout.IN_OUT:
            y = self.g.matmul(x, w, id=id)
            return y if b is None else self.g.add(y, b, id=f"{id}.b")
        return self.g.linear(x, w, b, id=id)

    def head_norm(self, li: int, role: str, x: str, j: int, id: str) -> str:
        """x with each head RMS-normalized by weight `role` ("q_norm", "k_norm"); x itself when
        the layer has no such weight."""
        w = self.weights(li, j).get(role)
        return x if w is None else self.g.kernel("head_rmsnorm", x, w, id=id, eps=self.spec.eps)

    def head_norm_grad(self, li: int, role: str, x: str, dy: str, j: int, id: str) -> str:
        """The gradient of `head_norm`'s input x given its output's, dy (dy itself when none)."""
        w = self.weights(li, j).get(role)
        return dy if w is None else self.g.kernel("head_rmsnorm_grad", x, w, dy, id=id, eps=self.spec.eps)

    def rope(self, x: str, cos: str, sin: str, id: str) -> str:
        return self.g.kernel("rope", x, cos, sin, id=id)

    def act(self, x: str, id: str) -> str:
        return self.g.kernel(self.spec.act.value, x, id=id)

    def attention_attrs(self, li: int | None = None) -> dict:
        """The attention ops' heads, key/value heads (unless multi-head) and scale on one GPU, and
        layer li's sliding window when it has one."""
        kv = {} if self.spec.kv_heads is None else {"kv_heads": self.split.kv_heads}
        w = self.spec.window(li)
        cap = {} if self.spec.softcap is None else {"softcap": self.spec.softcap}
        return {
            "heads": self.split.heads,
            **kv,
            "scale": self.spec.scale,
            **({"window": w} if w else {}),
            **cap,
        }

    def attention(
        self, q: str, ks: list[str], vs: list[str], id: str, offset: int, li: int | None = None
    ) -> str:
        """Causal attention (layer li's) of a query tile whose first row is `offset` rows after
        the first key tile's first row."""
        return self.g.kernel(
            "attention", q, *ks, *vs, id=id, **self.attention_attrs(li), offset=offset, causal=True
        )

    def qkv(
        self, li: int, h: str, cos: str, sin: str, stem: str, j: int, need_q: bool = True
    ) -> tuple[str, str, str]:
        """GPU j's normed input projected to q, k, v, with q (unless not `need_q`) and k rotated."""
        x = self.norm(li, "attn_norm", h, j, f"{stem}.norm1_g{j}")
        if self.spec.order is Order.BY_GPU:
            q, k, v = (
                self.project(li, r, x, j, f"{stem}.{r}_g{j}") if r != "q" or need_q else "" for r in "qkv"
            )
            q = q and self.head_norm(li, "q_norm", q, j, f"{stem}.qn_g{j}")
            k = self.head_norm(li, "k_norm", k, j, f"{stem}.kn_g{j}")
            q = q and self.rope(q, cos, sin, f"{stem}.qr_g{j}")
            return q, self.rope(k, cos, sin, f"{stem}.kr_g{j}"), v
        q = ""
        if need_q:
            q = self.project(li, "q", x, j, f"{stem}.q_g{j}")
            q = self.head_norm(li, "q_norm", q, j, f"{stem}.qn_g{j}")
            q = self.rope(q, cos, sin, f"{stem}.qr_g{j}")
        k = self.project(li, "k", x, j, f"{stem}.k_g{j}")
        k = self.head_norm(li, "k_norm", k, j, f"{stem}.kn_g{j}")
        v = self.project(li, "v", x, j, f"{stem}.v_g{j}")
        return q, self.rope(k, cos, sin, f"{stem}.kr_g{j}"), v

    def mlp(self, li: int, h: str, j: int, stem: str) -> str:
        """GPU j's partial of the gated MLP on its hidden state h (before the sum over GPUs)."""
        x = self.norm(li, "mlp_norm", h, j, f"{stem}.norm2_g{j}")
        if self.spec.moe is not None:
            return self.moe(li, x, j, stem)
        gate_id, up_id, mul_id = self.spec.mlp_ids
        gate = self.project(li, "gate", x, j, f"{stem}.{gate_id}_g{j}")
        if self.spec.order is Order.BY_GPU:
            up = self.project(li, "up", x, j, f"{stem}.{up_id}_g{j}")
            a = self.act(gate, f"{stem}.{self.spec.act.value}_g{j}")
        else:
            a = self.act(gate, f"{stem}.{self.spec.act.value}_g{j}")
            up = self.project(li, "up", x, j, f"{stem}.{up_id}_g{j}")
        m = self.g.mul(a, up, id=f"{stem}.{mul_id}_g{j}")
        return self.project(li, "down", m, j, f"{stem}.down_g{j}")

    def moe(self, li: int, x: str, j: int, stem: str, keep: dict | None = None) -> str:
        """GPU j's partial of the mixture of experts on its normed input x: the router's choice
        (`moe_route`), every expert's SwiGLU on GPU j's block of its units, each conditional on
        the router's column for it (a step loads and runs only the experts some row chose), and
        their weighted sum (`moe_combine`, which reads only the chosen ones).

        `keep` (training): gets what the backward reads ("logits", "route", "experts": per expert
        its gate, act, up and down); the weights are not conditional then (the forward and the
        recomputation read them, and the recomputation's router comes after the forward) and no
        sum is made ("")."""
        moe, g, act = self.spec.moe, self.g, self.spec.act.value
        assert moe is not None and self.experts is not None  # a mixture's builder gives its experts
        logits = g.linear(x, self.weights(li, j)["router"], id=f"{stem}.router_g{j}")
        route = g.kernel("moe_route", logits, id=f"{stem}.route_g{j}", top_k=moe.top_k)
        outs, kept = [], []
        for n in range(moe.experts):
            w, e = self.experts(li, j, n), f"{stem}.e{n}"
            gate = g.linear(x, w["gate"], id=f"{e}.gate_g{j}")
            a = self.act(gate, f"{e}.{act}_g{j}")
            up = g.linear(x, w["up"], id=f"{e}.up_g{j}")
            m = g.mul(a, up, id=f"{e}.mul_g{j}")
            down = g.linear(m, w["down"], id=f"{e}.down_g{j}")
            for vid in (*(w.values() if keep is None else ()), gate, a, up, m, down):
                if moe.conditional:
                    g.condition(vid, route, n)
            outs.append(down)
            kept.append({"gate": gate, "a": a, "up": up, "down": down})
        if keep is not None:
            keep |= {"logits": logits, "route": route, "experts": kept}
            return ""
        return g.kernel("moe_combine", route, *outs, id=f"{stem}.moe_g{j}")

    # ---- moving between GPUs -----------------------------------------------------------------
    def broadcast(self, x: str, stem: str) -> list[str]:
        """x on every GPU: sent from its own to the others (`{stem}_to{j}`)."""
        w = self.g[x].gpu
        return [x if j == w else self.g.transfer(x, j, id=f"{stem}_to{j}") for j in range(self.G)]

    def all_reduce(
        self,
        parts: list[str],
        owner: int,
        stem: str,
        residual: str | None = None,
        broadcast: bool = True,
        norm: tuple[int, str] | None = None,
    ) -> list[str]:
        """The sum of one partial per GPU (and `residual`) on `owner`, then sent back to every GPU
        (only `[sum]` when not `broadcast`); `norm` (layer, role): the parts' sum normed before the
        residual is added (a norm is not linear: it waits for every GPU's part)."""
        g = self.g
        moved = [p if j == owner else g.transfer(p, owner, id=f"{stem}_p{j}") for j, p in enumerate(parts)]
        if norm is not None:
            part = moved[0] if len(moved) == 1 else g.add(*moved, id=f"{stem}.sum", gpu=owner)
            moved = [self.norm(norm[0], norm[1], part, owner, f"{stem}.post")]
        total = g.add(*([residual] if residual else []), *moved, id=stem, gpu=owner)
        return self.broadcast(total, stem) if broadcast else [total]

    def post_norm(self, li: int, role: str) -> tuple[int, str] | None:
        """(li, role) when the layer norms its block's output before the residual add, else None."""
        return (li, role) if getattr(self.spec.weights, role) else None

    # ---- the two blocks of a layer -----------------------------------------------------------
    def attention_block(
        self,
        li: int,
        h: list[str],
        cos: list[str],
        sin: list[str],
        stem: str,
        owner: int,
        attend: Attend,
        need_q: bool = True,
    ) -> list[str]:
        """Norm, q/k/v, `attend` and the output projection on every GPU, summed with the residual
        h[owner] on `owner`: the hidden state per GPU ([] when not `need_q`: only k and v are
        made, for `attend` to keep)."""
        G = self.G
        if self.spec.order is Order.BY_GPU:
            parts = []
            for j in range(G):
                a = attend(j, *self.qkv(li, h[j], cos[j], sin[j], stem, j, need_q))
                parts.append(a and self.project(li, "o", a, j, f"{stem}.o_g{j}"))
        else:
            qkv = [self.qkv(li, h[j], cos[j], sin[j], stem, j, need_q) for j in range(G)]
            att = [attend(j, *x) for j, x in enumerate(qkv)]
            parts = [a and self.project(li, "o", a, j, f"{stem}.o_g{j}") for j, a in enumerate(att)]
        if not need_q:
            return []
        post = self.post_norm(li, "attn_post_norm")
        return self.all_reduce(parts, owner, f"{stem}.h1", residual=h[owner], norm=post)

    def mlp_block(self, li: int, h1: list[str], owner: int, stem: str, last: bool) -> list[str]:
        """The MLP on every GPU summed with the residual h1[owner] on `owner`: the layer's output
        per GPU, or on `owner` only when `last`."""
        parts = [self.mlp(li, h1[j], j, stem) for j in range(self.G)]
        post = self.post_norm(li, "mlp_post_norm")
        return self.all_reduce(parts, owner, f"{stem}.h2", residual=h1[owner], broadcast=not last, norm=post)
