"""The tensor-parallel decoder layer of LLaMA-style models, built once for every graph that has one.

A layer (Touvron et al., 2023): RMSNorm, Q/K/V projections, rotary embedding, causal
(grouped-query) attention, output projection, residual add, RMSNorm, gated MLP, residual add.
Split over G GPUs Megatron-style (Shoeybi et al., 2019): each GPU holds heads/G query heads, its
key/value heads and ffn/G MLP units, computes partial output and down projections, which the row
tile's owner GPU sums with the residual and sends back to every GPU (`Layer.all_reduce`).

`LayerSpec` describes a layer: its sizes, norm epsilon, rotary embedding, attention scale,
activation and the name of each weight (optional ones too: the q/k/v projections' biases, the
per-head RMSNorm of queries and keys). A model family is a `LayerSpec` (from its config.json)
plus what its layer adds; `Layer` adds a layer's vertices to a TaskGraph, and is what the
synthetic workload (`workloads.llama`) and the checkpoint models (`workloads.llm.model`,
`workloads.llm.train`) build their layers with.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum

import torch

from disco_ray.graph.taskgraph import TaskGraph

from .packed import dequantized

ROW_SPLIT = ("q", "k", "v", "gate", "up")  # output rows split over the GPUs
COL_SPLIT = ("o", "down")  # input columns split over the GPUs


class Activation(Enum):
    """The gated MLP's activation, act(x W_gate) * (x W_up); its value is the op's name."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"  # GELU's tanh approximation (Gemma's gelu_pytorch_tanh)

    @property
    def grad(self) -> str:
        """The op of its backward: dh * act'(a) from a and dh."""
        return f"{self.value}_grad"


class Layout(Enum):
    """How a projection's weight is stored, and the op that applies it."""

    IN_OUT = "matmul"  # [in, out]: x @ w
    OUT_IN = "linear"  # [out, in], as checkpoints and torch.nn.Linear store it: x @ w^T


class Order(Enum):
    """The order a layer's vertices are added in: a TaskGraph's order is the planner's serial order,
    so each graph keeps the one its plans were made and measured with."""

    # per GPU: norm, q, k, v, rotations, attention, o; MLP: gate, up, act (the synthetic workload)
    BY_GPU = "by_gpu"
    # per GPU: norm, q, rotated q, k, v, rotated k; then attention, then o on every GPU (what a
    # KV cache writes goes in between); MLP: gate, act, up (the checkpoint models)
    BY_STEP = "by_step"


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """The name of each weight of a layer: a checkpoint tensor's, after the layer's prefix
    (`model.layers.{i}.`), or a random weight's input id stem."""

    attn_norm: str = "input_layernorm.weight"
    q: str = "self_attn.q_proj.weight"
    k: str = "self_attn.k_proj.weight"
    v: str = "self_attn.v_proj.weight"
    o: str = "self_attn.o_proj.weight"
    mlp_norm: str = "post_attention_layernorm.weight"
    gate: str = "mlp.gate_proj.weight"
    up: str = "mlp.up_proj.weight"
    down: str = "mlp.down_proj.weight"
    # optional weights (None: the layer has none): the norms of the attention's and the MLP's
    # output before the residual add (Gemma 2); the q/k/v projections' biases (Qwen2), split like
    # their projection's output rows; the per-head RMSNorm weights of q and k (Qwen3)
    attn_post_norm: str | None = None
    mlp_post_norm: str | None = None
    q_bias: str | None = None
    k_bias: str | None = None
    v_bias: str | None = None
    q_norm: str | None = None
    k_norm: str | None = None

    def items(self) -> list[tuple[str, str]]:
        """(role, name) of every weight the layer has, in field order (`ROLES` first)."""
        return [(f.name, n) for f in fields(self) if (n := getattr(self, f.name)) is not None]

    def modules(self) -> dict[str, tuple[str, ...]]:
        """The linear modules (PEFT's names, e.g. "q_proj" or Phi-3's "qkv_proj") -> the roles
        each one's weight holds, in `ROLES` order (several: a fused projection)."""
        out: dict[str, tuple[str, ...]] = {}
        for role, name in self.items():
            if role in ROW_SPLIT or role in COL_SPLIT:
                mod = name.split(".")[-2]
                out[mod] = (*out.get(mod, ()), role)
        return out


ROLES = tuple(r for r, _ in LayerWeights().items())  # the weights every layer has, by what they do
BIASES = {"q_bias": "q", "k_bias": "k", "v_bias": "v"}  # a bias -> its projection
EXPERT_ROLES = ("gate", "up", "down")  # a mixture's expert weights: `LayerWeights` names them with {n}
EXPERT_TARGETS = ("w1", "w2", "w3")  # peft's names of Mixtral's experts' gate, down and up modules


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A sparse mixture-of-experts MLP (Mixtral): a router picks `top_k` of `experts` SwiGLU
    experts per token; each expert's weights are named by `LayerWeights` gate/up/down with {n}."""

    experts: int  # num_local_experts
    top_k: int  # num_experts_per_tok
    router: str = "block_sparse_moe.gate.weight"  # [experts, dim], after the layer's prefix
    conditional: bool = True  # False: every expert is loaded and run at every step (a baseline)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One decoder layer: what the layer builder needs to know of a model family."""

    dim: int  # hidden size
    heads: int  # query heads
    kv_heads: int | None  # key/value heads; None: multi-head attention (its vertices name none)
    head_dim: int
    ffn: int  # MLP hidden units
    eps: float  # RMSNorm epsilon
    scale: float  # attention's softmax scale (head_dim ** -0.5 in LLaMA)
    rope_theta: float = 10000.0
    rope: Mapping = field(default_factory=lambda: {"rope_type": "default"})  # scaling and its parameters
    act: Activation = Activation.SILU
    weights: LayerWeights = field(default_factory=LayerWeights)
    layout: Layout = Layout.OUT_IN
    order: Order = Order.BY_STEP
    # the vertex ids of the MLP's gate and up projections, and of their product
    mlp_ids: tuple[str, str, str] = ("gate", "up", "mul")
    # per layer, its sliding attention window (None: full attention); empty: every layer full
    windows: tuple[int | None, ...] = ()

    # Gemma 2: norms scaled by (norm_offset + w); attention scores soft-capped (None: not)
    norm_offset: float = 0.0
    softcap: float | None = None

    moe: MoeSpec | None = None  # a mixture of experts instead of the MLP (None: the dense MLP)

    def window(self, li: int | None) -> int | None:
        """Layer li's sliding attention window: a query at position p sees keys in (p - window, p]
        (None: every earlier key)."""
        return self.windows[li] if li is not None and self.windows else None

    def first_key(self, li: int | None, pos: int) -> int:
        """The first key position a query of layer li at position `pos` sees."""
        w = self.window(li)
        return 0 if w is None else max(0, pos - w + 1)

    @property
    def kv(self) -> int:
        """Key/value heads (query heads in multi-head attention)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    def whole(self, role: str) -> tuple[int, ...]:
        """The whole weight `role`'s shape, [out, in] for a projection."""
        q, kv = self.heads * self.head_dim, self.kv * self.head_dim
        return {
            "attn_norm": (self.dim,),
            "mlp_norm": (self.dim,),
            "attn_post_norm": (self.dim,),
            "mlp_post_norm": (self.dim,),
            "q": (q, self.dim),
            "k": (kv, self.dim),
            "v": (kv, self.dim),
            "o": (self.dim, q),
            "gate": (self.ffn, self.dim),
            "up": (self.ffn, self.dim),
            "down": (self.dim, self.ffn),
            "q_bias": (q,),
            "k_bias": (kv,),
            "v_bias": (kv,),
            "q_norm": (self.head_dim,),
            "k_norm": (self.head_dim,),
        }[role]

    def offset(self, role: str) -> int:
        """The first row of weight `role` in its checkpoint tensor: roles that name one tensor (a
        fused projection: Phi-3's qkv_proj, gate_up_proj) are stacked by rows in `ROLES` order."""
        name = getattr(self.weights, role)
        return sum(self.whole(r)[0] for r, n in self.weights.items()[: ROLES.index(role)] if n == name)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """A layer's checkpoint tensors (names after the layer's prefix) with their shapes."""
        out: dict[str, tuple[int, ...]] = {}
        for role, name in self.weights.items():
            shape = self.whole(role)
            if name in out:  # a fused projection: this role's rows follow the previous roles'
                shape = (out[name][0] + shape[0], *shape[1:])
            out[name] = shape
        return out


@dataclass(frozen=True, slots=True)
class Split:
    """How a model is cut over `gpus` GPUs."""

    gpus: int
    heads: int  # query heads per GPU
    kv_heads: int  # key/value heads per GPU
    ffn: int  # MLP units per GPU
    vocab: tuple[tuple[int, int], ...]  # each GPU's vocabulary rows [lo, hi)
    kv_first: tuple[int, ...]  # each GPU's first key/value head

    @classmethod
    def of(cls, spec: LayerSpec, gpus: int, vocab: int = 0) -> Split:
        """The split of layers `spec` (and a vocabulary of `vocab` rows) over `gpus` GPUs; fewer
        key/value heads than GPUs: each GPU holds a copy of the one its query heads share."""
        bounds = [round(j * vocab / gpus) for j in range(gpus + 1)]
        hg = spec.heads // gpus
        group = spec.heads // spec.kv  # query heads per key/value head
        return cls(
            gpus,
            hg,
            max(1, spec.kv // gpus),
            spec.ffn // gpus,
            tuple(itertools.pairwise(bounds)),
            tuple(j * hg // group for j in range(gpus)),
        )

    def shard(self, role: str, j: int, head_dim: int) -> tuple[int, int]:
        """GPU j's rows of a row-split weight's output, or columns of a column-split one's input."""
        if role in ("q", "o"):
            return (j * self.heads * head_dim, (j + 1) * self.heads * head_dim)
        if role in ("k", "v"):
            return (self.kv_first[j] * head_dim, (self.kv_first[j] + self.kv_heads) * head_dim)
        return (j * self.ffn, (j + 1) * self.ffn)

    def block(
        self, spec: LayerSpec, role: str, j: int
    ) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """(rows, columns) of GPU j's block of weight `role` stored [out, in] (None: all), in the
        checkpoint tensor that holds it (offset by `LayerSpec.offset` in a fused one); a bias's
        rows are its projection's."""
        if role in ROW_SPLIT or role in BIASES:
            lo, hi = self.shard(BIASES.get(role, role), j, spec.head_dim)
            at = spec.offset(role) if role in ROW_SPLIT else 0  # the role's rows within a fused tensor
            return (at + lo, at + hi), None
        if role in COL_SPLIT:
            return None, self.shard(role, j, spec.head_dim)
        return None, None

    def block_shape(self, spec: LayerSpec, role: str, j: int) -> tuple[int, ...]:
        """The shape of GPU j's block of weight `role`, as `spec.layout` stores it."""
        shape = list(spec.whole(role))
        for axis, span in enumerate(self.block(spec, role, j)):
            if span is not None:
                shape[axis] = span[1] - span[0]
        return tuple(shape[::-1]) if spec.layout is Layout.IN_OUT else tuple(shape)


def rope_tables(
    spec: LayerSpec, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), head_dim] of the rotate-half rotary embedding, computed as
    transformers' LlamaRotaryEmbedding does (float32, then cast), for RoPE types default,
    linear and llama3."""
    hd = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    r = spec.rope
    if r["rope_type"] == "linear":
        inv = inv / r["factor"]
    elif r["rope_type"] == "llama3":
        factor, lo, hi = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
        old = r["original_max_position_embeddings"]
        lo_wave, hi_wave = old / lo, old / hi
        wave = 2 * math.pi / inv
        scaled = torch.where(wave > lo_wave, inv / factor, inv)
        smooth = (old / wave - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wave < hi_wave) & ~(wave > lo_wave)
        inv = torch.where(medium, smoothed, scaled)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


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
