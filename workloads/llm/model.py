"""A whole LLaMA model from a checkpoint as TaskGraphs: prefill of a prompt, and decode steps.

The graphs follow LlamaForCausalLM: token embedding, decoder layers (RMSNorm, Q/K/V projections,
rotary embedding, causal grouped-query attention, output projection, SwiGLU MLP, residuals), the
final RMSNorm and the LM head. They are tensor-parallel over G GPUs as `workloads.llama` is
(Megatron-style): each GPU holds heads/G query heads, kv_heads/G key/value heads and ffn/G MLP
units, computes partial output and down projections, which the row tile's owner GPU sums with
the residual and sends back to every GPU. The vocabulary is split over the GPUs too: each holds
rows [lo, hi) of the embedding table and of the LM head; an embedding lookup gives zeros for ids
outside a GPU's rows, so the shards' lookups sum to the whole table's, and each GPU computes its
columns of the logits. Every weight is a graph input whose `Source` names its block of the
checkpoint, so each worker reads only its own shard of each matrix, in the layout the checkpoint
stores it ([out, in], used by the `linear` op).

The KV cache (TURNIP section 9 names generation, a cache that grows per token, as a limitation):
the cache is cut into blocks of `block` positions, one state per layer, GPU, K or V and block,
kept by the workers across runs (`TaskGraph` states, `actors.store`):
- prefill (`cache=True`) runs the prompt in row tiles of `block` rows, so the rotated keys and
  the values of tile t are block t, and carries them into the states `kc.l{i}.b{t}_g{j}` and
  `vc.l{i}.b{t}_g{j}`;
- a decode step for position p uses the graph of `blocks` = p // block + 1: the full blocks
  0..blocks-2 are state inputs read as they are, the last block is read, gets the new key and
  value row written at p (`kv_write`, with p a run-time input: no host sync on a GPU), and is
  carried back; attention (`attention_at`) masks positions > p on the device.
So one plan serves `block` consecutive tokens: the driver plans a decode graph per bucket of
cache length, never per token, and a step's run-time inputs are the token, p and p's rotary row.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from disco_ray.graph.errors import UsageError
from disco_ray.graph.taskgraph import TaskGraph

from .checkpoint import Checkpoint, LlamaConfig


@dataclass(frozen=True, slots=True)
class Split:
    """How the model is cut over `gpus` GPUs."""

    gpus: int
    heads: int  # query heads per GPU
    kv_heads: int  # key/value heads per GPU
    ffn: int  # MLP units per GPU
    vocab: tuple[tuple[int, int], ...]  # each GPU's vocabulary rows [lo, hi)
    kv_first: tuple[int, ...]  # each GPU's first key/value head

    @classmethod
    def of(cls, cfg: LlamaConfig, gpus: int) -> Split:
        cfg.check_split(gpus)
        bounds = [round(j * cfg.vocab / gpus) for j in range(gpus + 1)]
        hg = cfg.heads // gpus
        group = cfg.heads // cfg.kv_heads  # query heads per key/value head
        kvg = max(1, cfg.kv_heads // gpus)  # fewer key/value heads than GPUs: one copy on each
        return cls(
            gpus,
            hg,
            kvg,
            cfg.ffn // gpus,
            tuple(itertools.pairwise(bounds)),
            tuple(j * hg // group for j in range(gpus)),
        )


@dataclass(slots=True)
class ModelGraph:
    """One TaskGraph of the model and how to feed it and read it."""

    kind: str  # "prefill" or "decode"
    taskgraph: TaskGraph
    rows: int  # token rows per run: blocks * block (prefill) or 1 (decode)
    block: int
    blocks: int  # cache blocks: the prompt's (prefill), those the step reads (decode)
    dtype: str = "float32"
    logits: list[tuple[int, list[str]]] = field(default_factory=list)  # (first row, output per GPU)
    split: Split | None = None
    tiles: list[tuple[int, int]] = field(default_factory=list)  # prefill: (first row, rows) per tile

    def feed(self, cfg: LlamaConfig, ids: list[int], pos: int = 0) -> dict[str, torch.Tensor]:
        """The caller inputs of one run: token ids (padded to `rows`), positions from `pos`."""
        g = self.taskgraph.gpus
        if len(ids) > self.rows:
            raise UsageError(f"{len(ids)} tokens for a graph of {self.rows} rows")
        ids = list(ids) + [0] * (self.rows - len(ids))
        cos, sin = rope_tables(cfg, torch.arange(pos, pos + self.rows), getattr(torch, self.dtype))
        tok = torch.tensor(ids, dtype=torch.int64)
        out: dict[str, torch.Tensor] = {}
        if self.kind == "decode":
            for j in range(g):
                out |= {
                    f"tok_g{j}": tok.clone(),
                    f"pos_g{j}": torch.tensor([pos], dtype=torch.int64),
                    f"cos_g{j}": cos.clone(),
                    f"sin_g{j}": sin.clone(),
                }
            return out
        for t, (r0, n) in enumerate(self.tiles):
            rows = slice(r0, r0 + n)
            for j in range(g):
                out |= {
                    f"tok_t{t}_g{j}": tok[rows].clone(),
                    f"cos_t{t}_g{j}": cos[rows].clone(),
                    f"sin_t{t}_g{j}": sin[rows].clone(),
                }
        return out

    def gather(self, outs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The logits [rows covered, vocab] (float32) from the outputs of a run."""
        parts = [torch.cat([outs[o] for o in per_gpu], dim=1) for _, per_gpu in self.logits]
        return torch.cat(parts, dim=0).float()


def rope_tables(
    cfg: LlamaConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), head_dim] of the rotate-half rotary embedding, computed as
    transformers' LlamaRotaryEmbedding does (float32, then cast), for RoPE types default,
    linear and llama3."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    r = cfg.rope
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


class _Builder:
    """Adds the model's vertices to one TaskGraph; weights become sourced inputs on first use."""

    def __init__(self, ck: Checkpoint, gpus: int, dtype: str):
        self.ck, self.cfg, self.dtype = ck, ck.config, dtype
        self.split = Split.of(self.cfg, gpus)
        self.g = TaskGraph(gpus)
        self.G = gpus

    def weight(self, id: str, name: str, j: int, rows=None, cols=None) -> str:
        if id not in self.g:
            _, full, _ = self.ck.tensors[name]
            shape = list(full)
            if rows is not None:
                shape[0] = rows[1] - rows[0]
            if cols is not None:
                shape[1] = cols[1] - cols[0]
            self.g.input(id, tuple(shape), self.dtype, gpu=j, source=self.ck.source(name, rows, cols))
        return id

    def embed_table(self, j: int) -> str:
        lo, hi = self.split.vocab[j]
        return self.weight(f"embed_g{j}", "model.embed_tokens.weight", j, rows=(lo, hi))

    def head_table(self, j: int) -> str:
        if self.cfg.tie:  # tied: the LM head is the embedding table (one input, one host copy)
            return self.embed_table(j)
        lo, hi = self.split.vocab[j]
        return self.weight(f"head_g{j}", "lm_head.weight", j, rows=(lo, hi))

    def layer_weights(self, li: int, j: int) -> dict[str, str]:
        s, hd = self.split, self.cfg.head_dim
        q = (j * s.heads * hd, (j + 1) * s.heads * hd)
        kv = (s.kv_first[j] * hd, (s.kv_first[j] + s.kv_heads) * hd)
        f = (j * s.ffn, (j + 1) * s.ffn)
        p = f"model.layers.{li}."
        w = self.weight
        return {
            "attn_norm": w(f"l{li}.attn_norm_g{j}", p + "input_layernorm.weight", j),
            "q": w(f"l{li}.q_g{j}", p + "self_attn.q_proj.weight", j, rows=q),
            "k": w(f"l{li}.k_g{j}", p + "self_attn.k_proj.weight", j, rows=kv),
            "v": w(f"l{li}.v_g{j}", p + "self_attn.v_proj.weight", j, rows=kv),
            "o": w(f"l{li}.o_g{j}", p + "self_attn.o_proj.weight", j, cols=q),
            "mlp_norm": w(f"l{li}.mlp_norm_g{j}", p + "post_attention_layernorm.weight", j),
            "gate": w(f"l{li}.gate_g{j}", p + "mlp.gate_proj.weight", j, rows=f),
            "up": w(f"l{li}.up_g{j}", p + "mlp.up_proj.weight", j, rows=f),
            "down": w(f"l{li}.down_g{j}", p + "mlp.down_proj.weight", j, cols=f),
        }

    def all_reduce(self, parts: list[str], owner: int, stem: str, residual: str | None = None) -> list[str]:
        """The sum of one partial per GPU (and `residual`) on `owner`, then sent back to every GPU."""
        g = self.g
        moved = [p if j == owner else g.transfer(p, owner, id=f"{stem}_p{j}") for j, p in enumerate(parts)]
        total = g.add(*([residual] if residual else []), *moved, id=stem, gpu=owner)
        return [total if j == owner else g.transfer(total, j, id=f"{stem}_to{j}") for j in range(self.G)]

    def embed(self, tok: list[str], owner: int, stem: str) -> list[str]:
        g = self.g
        parts = [
            g.kernel(
                "embedding", tok[j], self.embed_table(j), id=f"{stem}.emb_g{j}", start=self.split.vocab[j][0]
            )
            for j in range(self.G)
        ]
        if self.G == 1:
            return parts
        return self.all_reduce(parts, owner, f"{stem}.h0")

    def attn_in(self, li: int, h: list[str], cos: list[str], sin: list[str], stem: str, need_q: bool = True):
        """Per GPU: the normed input's rotated q (unless not `need_q`) and k, and its v."""
        g, eps = self.g, self.cfg.eps
        out = []
        for j in range(self.G):
            w = self.layer_weights(li, j)
            x = g.rmsnorm(h[j], w["attn_norm"], eps=eps, id=f"{stem}.norm1_g{j}")
            q = ""
            if need_q:
                q = g.linear(x, w["q"], id=f"{stem}.q_g{j}")
                q = g.kernel("rope", q, cos[j], sin[j], id=f"{stem}.qr_g{j}")
            k = g.linear(x, w["k"], id=f"{stem}.k_g{j}")
            v = g.linear(x, w["v"], id=f"{stem}.v_g{j}")
            k = g.kernel("rope", k, cos[j], sin[j], id=f"{stem}.kr_g{j}")
            out.append((q, k, v))
        return out

    def attn_out_mlp(
        self, li: int, att: list[str], h: list[str], owner: int, stem: str, last: bool
    ) -> list[str]:
        """Output projection, residual, SwiGLU MLP, residual; the next hidden state per GPU (on
        `owner` only when `last`)."""
        g, eps = self.g, self.cfg.eps
        parts = [g.linear(att[j], self.layer_weights(li, j)["o"], id=f"{stem}.o_g{j}") for j in range(self.G)]
        h1 = self.all_reduce(parts, owner, f"{stem}.h1", residual=h[owner])
        parts = []
        for j in range(self.G):
            w = self.layer_weights(li, j)
            x = g.rmsnorm(h1[j], w["mlp_norm"], eps=eps, id=f"{stem}.norm2_g{j}")
            a = g.silu(g.linear(x, w["gate"], id=f"{stem}.gate_g{j}"), id=f"{stem}.silu_g{j}")
            m = g.mul(a, g.linear(x, w["up"], id=f"{stem}.up_g{j}"), id=f"{stem}.mul_g{j}")
            parts.append(g.linear(m, w["down"], id=f"{stem}.down_g{j}"))
        if last:
            moved = [
                p if j == owner else g.transfer(p, owner, id=f"{stem}.h2_p{j}") for j, p in enumerate(parts)
            ]
            return [g.add(h1[owner], *moved, id=f"{stem}.h2", gpu=owner)]
        return self.all_reduce(parts, owner, f"{stem}.h2", residual=h1[owner])

    def head(self, h: str, owner: int, stem: str) -> list[str]:
        """Final norm and this row tile's logits, one column block per GPU."""
        g = self.g
        hs = [h if j == owner else g.transfer(h, j, id=f"{stem}.hf_to{j}") for j in range(self.G)]
        out = []
        for j in range(self.G):
            norm = self.weight(f"norm_g{j}", "model.norm.weight", j)
            x = g.rmsnorm(hs[j], norm, eps=self.cfg.eps, id=f"{stem}.normf_g{j}")
            out.append(g.linear(x, self.head_table(j), id=f"{stem}.logits_g{j}"))
        g.output(*out)
        return out


def prefill_graph(
    ck: Checkpoint,
    gpus: int,
    blocks: int,
    block: int,
    dtype: str | None = None,
    logits: str = "all",
    cache: bool = False,
    tile: int | None = None,
) -> ModelGraph:
    """The prompt, `blocks` * `block` tokens (padded), through the whole model in row tiles.

    Args:
        logits: "all" (every row's logits) or "last" (the last tile's only: what generation needs).
        cache: carry each layer's rotated keys and values into the KV cache blocks.
        tile: rows per tile, a multiple of `block` (default `block`); the last tile may be shorter.
            Larger tiles make larger matrix products (faster on a CPU) and larger activations.
    """
    if logits not in ("all", "last"):
        raise UsageError(f"logits must be 'all' or 'last', got {logits!r}")
    tile = block if tile is None else tile
    if tile < block or tile % block:
        raise UsageError(f"the prefill tile {tile} must be a multiple of the cache block {block}")
    rows = blocks * block
    spans = [(r0, min(tile, rows - r0)) for r0 in range(0, rows, tile)]
    b = _Builder(ck, gpus, dtype or ck.config.dtype)
    g, cfg, s, G = b.g, b.cfg, b.split, gpus
    hd = cfg.head_dim
    n = len(spans)
    tok = [
        [g.input(f"tok_t{t}_g{j}", (r,), "int64", gpu=j) for j in range(G)] for t, (_, r) in enumerate(spans)
    ]
    cos = [
        [g.input(f"cos_t{t}_g{j}", (r, hd), b.dtype, gpu=j) for j in range(G)]
        for t, (_, r) in enumerate(spans)
    ]
    sin = [
        [g.input(f"sin_t{t}_g{j}", (r, hd), b.dtype, gpu=j) for j in range(G)]
        for t, (_, r) in enumerate(spans)
    ]
    h = [b.embed(tok[t], t % G, f"t{t}") for t in range(n)]
    for li in range(cfg.layers):
        ks: list[list[str]] = [[] for _ in range(G)]
        vs: list[list[str]] = [[] for _ in range(G)]
        last = li == cfg.layers - 1
        for t, (r0, r) in enumerate(spans):
            stem = f"l{li}.t{t}"
            # the last layer of a tile whose logits nobody wants only gives the cache its k, v
            needed = not (last and logits == "last" and t < n - 1)
            qkv = b.attn_in(li, h[t], cos[t], sin[t], stem, need_q=needed)
            att = []
            for j, (q, k, v) in enumerate(qkv):
                ks[j].append(k)
                vs[j].append(v)
                if cache:
                    _save_blocks(g, k, f"kc.l{li}", r0, r, block, j)
                    _save_blocks(g, v, f"vc.l{li}", r0, r, block, j)
                if not needed:
                    continue
                att.append(
                    g.kernel(
                        "attention",
                        q,
                        *ks[j],
                        *vs[j],
                        id=f"{stem}.attn_g{j}",
                        heads=s.heads,
                        kv_heads=s.kv_heads,
                        scale=hd**-0.5,
                        offset=r0,
                        causal=True,
                    )
                )
            if needed:
                h[t] = b.attn_out_mlp(li, att, h[t], t % G, stem, last)
    out = []
    for t, (r0, _) in enumerate(spans):
        if logits == "all" or t == n - 1:
            out.append((r0, b.head(h[t][0], t % G, f"t{t}")))
    return ModelGraph("prefill", g, rows, block, blocks, b.dtype, out, s, spans)


def _save_blocks(g: TaskGraph, x: str, stem: str, r0: int, rows: int, block: int, j: int) -> None:
    """Carries the tile x (rows r0..r0+rows) into the KV cache states of its blocks."""
    if rows == block:
        g.save_state(x, f"{stem}.b{r0 // block}_g{j}")
        return
    for k in range(rows // block):
        part = g.kernel("slice", x, id=f"{x}.b{k}", axis=0, start=k * block, stop=(k + 1) * block)
        g.save_state(part, f"{stem}.b{r0 // block + k}_g{j}")


def decode_graph(ck: Checkpoint, gpus: int, blocks: int, block: int, dtype: str | None = None) -> ModelGraph:
    """One token at a run-time position p in [(blocks-1)*block, blocks*block), attending to the
    KV cache blocks 0..blocks-1 (states), writing its key and value into the last one."""
    b = _Builder(ck, gpus, dtype or ck.config.dtype)
    g, cfg, s, G = b.g, b.cfg, b.split, gpus
    hd = cfg.head_dim
    kvw = s.kv_heads * hd
    tok = [g.input(f"tok_g{j}", (1,), "int64", gpu=j) for j in range(G)]
    pos = [g.input(f"pos_g{j}", (1,), "int64", gpu=j) for j in range(G)]
    cos = [g.input(f"cos_g{j}", (1, hd), b.dtype, gpu=j) for j in range(G)]
    sin = [g.input(f"sin_g{j}", (1, hd), b.dtype, gpu=j) for j in range(G)]
    h = b.embed(tok, 0, "d")
    cur = blocks - 1
    for li in range(cfg.layers):
        stem = f"d.l{li}"
        att = []
        for j, (q, k, v) in enumerate(b.attn_in(li, h, cos, sin, stem)):
            kc, vc = (
                [
                    g.input(f"{c}c.l{li}.b{n}_g{j}", (block, kvw), b.dtype, gpu=j, state=True)
                    for n in range(blocks)
                ]
                for c in "kv"
            )
            kn = g.kernel("kv_write", kc[cur], k, pos[j], id=f"{stem}.kw_g{j}", start=cur * block)
            vn = g.kernel("kv_write", vc[cur], v, pos[j], id=f"{stem}.vw_g{j}", start=cur * block)
            g.save_state(kn, kc[cur])
            g.save_state(vn, vc[cur])
            att.append(
                g.kernel(
                    "attention_at",
                    q,
                    pos[j],
                    *kc[:cur],
                    kn,
                    *vc[:cur],
                    vn,
                    id=f"{stem}.attn_g{j}",
                    heads=s.heads,
                    kv_heads=s.kv_heads,
                    scale=hd**-0.5,
                )
            )
        h = b.attn_out_mlp(li, att, h, 0, stem, li == cfg.layers - 1)
    return ModelGraph("decode", g, 1, block, blocks, b.dtype, [(0, b.head(h[0], 0, "d"))], s, [(0, 1)])
