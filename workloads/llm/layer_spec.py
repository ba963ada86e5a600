"""What a LLaMA-style decoder layer is, apart from how its vertices are built (`layer.Layer`).

`LayerSpec` describes a layer: its sizes, norm epsilon, rotary embedding, attention scale,
activation, windows, soft-cap, mixture of experts and the name of each weight (`LayerWeights`,
optional ones too: biases, per-head and post norms); `Split` says how it is cut over the GPUs;
`rope_tables` gives the rotary rows. A model family (`workloads.llm.families`) is a `LayerSpec`
from its config.json plus what its layer adds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum

import torch

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
