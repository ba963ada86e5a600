"""A whole LLaMA model from a checkpoint as TaskGraphs: prefill of a prompt, and decode steps.

The graphs follow LlamaForCausalLM: token embedding, decoder layers (RMSNorm, Q/K/V projections,
rotary embedding, causal grouped-query attention, output projection, SwiGLU MLP, residuals), the
final RMSNorm and the LM head. The decoder layers are the layer builder's (`workloads.llm.layer`,
from `ModelConfig.spec`), tensor-parallel over G GPUs (Megatron-style): each GPU holds heads/G
query heads, kv_heads/G key/value heads and ffn/G MLP units, computes partial output and down
projections, which the row tile's owner GPU sums with the residual and sends back to every GPU;
between a layer's q/k/v and its attention a graph keeps its keys and values (prefill tiles, the
KV cache). The vocabulary is split over the GPUs too: each holds
rows [lo, hi) of the embedding table and of the LM head; an embedding lookup gives zeros for ids
outside a GPU's rows, so the shards' lookups sum to the whole table's, and each GPU computes its
columns of the logits. Every weight is a graph input whose `Source` names its block of the
checkpoint, so each worker reads only its own shard of each matrix, in the layout the checkpoint
stores it ([out, in], used by the `linear` op).

The KV cache (TURNIP section 9 names generation, a cache that grows per token, as a limitation):
the cache is cut into blocks of `block` positions, one state per layer, GPU, K or V and block,
kept by the workers across runs (`TaskGraph` states, `actors.tiers.store`):
- prefill (`cache=True`) runs the prompt in row tiles of `block` rows, so the rotated keys and
  the values of tile t are block t, and carries them into the states `kc.l{i}.b{t}_g{j}` and
  `vc.l{i}.b{t}_g{j}`;
- a decode step for position p uses the graph of `blocks` = p // block + 1: the full blocks
  0..blocks-2 are state inputs read as they are, the last block is read, gets the new key and
  value row written at p (`kv_write`, with p a run-time input: no host sync on a GPU), and is
  carried back; attention (`attention_at`) masks positions > p on the device. A layer with a
  sliding window reads only the blocks from `first_block` on (those reaching into the window of
  the bucket's first position); prefill tiles alike skip the key tiles wholly before theirs.
So one plan serves `block` consecutive tokens: the driver plans a decode graph per bucket of
cache length, never per token, and a step's run-time inputs are the token, p and p's rotary row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from disco_ray.graph.errors import UsageError
from disco_ray.graph.quant import Quant
from disco_ray.graph.taskgraph import TaskGraph

from .checkpoint import Checkpoint, ModelConfig
from .layer import COL_SPLIT, EXPERT_ROLES, ROW_SPLIT, Attend, Layer, LayerSpec, Split, rope_tables
from .packed import cache_block, dequantized, fused, kv_attrs, kv_rows, packed_linear, qembedding

PROJECTIONS = frozenset(ROW_SPLIT + COL_SPLIT)  # the weights a quantized checkpoint packs


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
    order: list[str] = field(default_factory=list)  # the planner's serial order (empty: the builder's)
    # a batch decode step that samples on the device: per micro-batch (first row, its tokens' id)
    tokens: list[tuple[int, str]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # per micro-batch: its rows' finished flags

    def feed(self, cfg: ModelConfig, ids: list[int], pos: int = 0) -> dict[str, torch.Tensor]:
        """The caller inputs of one run: token ids (padded to `rows`), positions from `pos`."""
        g = self.taskgraph.gpus
        if len(ids) > self.rows:
            raise UsageError(f"{len(ids)} tokens for a graph of {self.rows} rows")
        ids = list(ids) + [0] * (self.rows - len(ids))
        cos, sin = rope_tables(cfg.spec, torch.arange(pos, pos + self.rows), getattr(torch, self.dtype))
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


class _Builder:
    """Adds the model's vertices to one TaskGraph; weights become sourced inputs on first use."""

    def __init__(self, ck: Checkpoint, gpus: int, dtype: str):
        self.ck, self.cfg, self.dtype = ck, ck.config, dtype
        self.cfg.check_split(gpus)
        self.split = Split.of(self.cfg.spec, gpus, self.cfg.vocab)
        self.g = TaskGraph(gpus)
        self.G = gpus
        self.layer = Layer(self.g, self.cfg.spec, self.split, self.layer_weights)
        self.layer.experts = self.expert_weights
        # the embedding table and LM head: int8 whatever the layers' bits (their errors go
        # straight into the logits, as llama.cpp keeps its output matrix at more bits)
        q = self.ck.quant
        self.tables = None if q is None else Quant(8, q.group, q.layout)

    def weight(self, id: str, name: str, j: int, rows=None, cols=None, packed: Quant | None = None) -> str:
        """The input of block (rows, cols) of tensor `name` on GPU j; `packed`: read quantized
        so, and used through `packed.dequantized`."""
        if id not in self.g:
            _, full, _ = self.ck.tensors[name]
            shape = list(full)
            if rows is not None:
                shape[0] = rows[1] - rows[0]
            if cols is not None:
                shape[1] = cols[1] - cols[0]
            dtype = self.dtype
            if packed is not None:
                packed = packed.for_weight(tuple(shape))  # Layout.ROWS where the CPU kernel's does not fit
                shape, dtype = list(packed.packed_shape(tuple(shape))), "uint8"
            src = self.ck.source(name, rows, cols, packed)
            self.g.input(id, tuple(shape), dtype, gpu=j, source=src)
        return id

    def base_weight(self, li: int, role: str, j: int, like: str, id: str) -> str:
        """Layer li's projection `role` on GPU j as a matmul reads it, in `like`'s dtype (a packed
        one dequantized by vertex `id`)."""
        w = self.layer_weights(li, j)[role]
        cols = self.split.block_shape(self.cfg.spec, role, j)[1]
        return dequantized(self.g, w, cols, self.g[like].dtype, id)

    def embed_table(self, j: int) -> str:
        lo, hi = self.split.vocab[j]
        return self.weight(f"embed_g{j}", "model.embed_tokens.weight", j, rows=(lo, hi), packed=self.tables)

    def head_table(self, j: int) -> str:
        if self.cfg.tie:  # tied: the LM head is the embedding table (one input, one host copy)
            return self.embed_table(j)
        lo, hi = self.split.vocab[j]
        return self.weight(f"head_g{j}", "lm_head.weight", j, rows=(lo, hi), packed=self.tables)

    def lookup(self, tok: str, j: int, id: str) -> str:
        """The embedding rows of ids `tok` in GPU j's vocabulary shard (zeros outside it); of a
        packed table, the packed rows are looked up, then dequantized (`{id}.rows` -> `id`; in
        Layout.CPU, both by one `qembedding`)."""
        table, at = self.embed_table(j), self.embed_attrs(j)
        if self.g[table].dtype != "uint8":
            return self.g.kernel("embedding", tok, table, id=id, **at)
        xid = id if "scale" not in at else f"{id}.dq"
        if fused(self.g, table):  # the rows looked up and dequantized by one vertex
            x = qembedding(self.g, tok, table, self.cfg.dim, self.dtype, at["start"], xid)
        else:
            rows = self.g.kernel("embedding", tok, table, id=f"{id}.rows", start=at["start"])
            x = dequantized(self.g, table, self.cfg.dim, self.dtype, xid, rows)
        if "scale" not in at:
            return x
        return self.g.scale(x, at["scale"], id=id)  # the family's embedding scale, on the floats

    def head_weight(self, j: int, like: str, id: str) -> str:
        """GPU j's LM head block as a linear or matmul reads it, in `like`'s dtype."""
        return dequantized(self.g, self.head_table(j), self.cfg.dim, self.g[like].dtype, id)

    def layer_weights(self, li: int, j: int) -> dict[str, str]:
        """Layer li's weights on GPU j by role: GPU j's blocks of the checkpoint's tensors."""
        spec, p = self.cfg.spec, f"model.layers.{li}."
        out = {
            role: self.weight(
                f"l{li}.{role}_g{j}",
                p + name,
                j,
                *self.split.block(spec, role, j),
                packed=self.ck.quant if role in PROJECTIONS else None,
            )
            for role, name in spec.weights.items()
            if spec.moe is None or role not in EXPERT_ROLES
        }
        if spec.moe is not None:  # the router, whole on every GPU
            out["router"] = self.weight(f"l{li}.router_g{j}", p + spec.moe.router, j)
        return out

    def expert_weights(self, li: int, j: int, n: int) -> dict[str, str]:
        """Expert n of layer li's weights on GPU j by role (gate, up, down): its blocks."""
        spec, p = self.cfg.spec, f"model.layers.{li}."
        names = dict(spec.weights.items())
        return {
            role: self.weight(
                f"l{li}.e{n}.{role}_g{j}", p + names[role].format(n=n), j, *self.split.block(spec, role, j)
            )
            for role in EXPERT_ROLES
        }

    def logits(self, x: str, j: int, id: str) -> str:
        """GPU j's columns of the logits of normed rows x, soft-capped if the family caps them."""
        y = packed_linear(self.g, x, self.head_table(j), self.cfg.dim, id)
        cap = self.cfg.final_softcap
        return y if cap is None else self.g.kernel("softcap", y, id=f"{id}.cap", cap=cap)

    def embed_attrs(self, j: int) -> dict:
        """GPU j's embedding lookup's attributes: its first vocabulary row, and the scale of the
        family's embeddings (Gemma's sqrt(hidden_size), rounded to the dtype as transformers does)."""
        if not self.cfg.embed_scale:
            return {"start": self.split.vocab[j][0]}
        scale = float(torch.tensor(self.cfg.dim**0.5).to(getattr(torch, self.dtype)))
        return {"start": self.split.vocab[j][0], "scale": scale}

    def embed(self, tok: list[str], owner: int, stem: str) -> list[str]:
        parts = [self.lookup(tok[j], j, f"{stem}.emb_g{j}") for j in range(self.G)]
        if self.G == 1:
            return parts
        return self.layer.all_reduce(parts, owner, f"{stem}.h0")

    def head(self, h: str, owner: int, stem: str, keep: bool = True) -> list[str]:
        """Final norm and this row tile's logits, one column block per GPU (graph outputs when `keep`)."""
        g = self.g
        hs = self.layer.broadcast(h, f"{stem}.hf")
        out = []
        for j in range(self.G):
            norm = self.weight(f"norm_g{j}", "model.norm.weight", j)
            x = g.rmsnorm(hs[j], norm, id=f"{stem}.normf_g{j}", **self.layer.norm_attrs())
            out.append(self.logits(x, j, f"{stem}.logits_g{j}"))
        if keep:
            g.output(*out)
        return out


def prefill_graph(
    ck: Checkpoint,
    gpus: int,
    blocks: int,
    block: int,
    *,
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
    g, G = b.g, gpus
    n = len(spans)
    tok, cos, sin = (
        [[g.input(f"{x}_t{t}_g{j}", shape(r), dt, gpu=j) for j in range(G)] for t, (_, r) in enumerate(spans)]
        for x, shape, dt in (
            ("tok", lambda r: (r,), "int64"),
            ("cos", lambda r: (r, b.cfg.head_dim), b.dtype),
            ("sin", lambda r: (r, b.cfg.head_dim), b.dtype),
        )
    )
    h = [b.embed(tok[t], t % G, f"t{t}") for t in range(n)]
    for li in range(b.cfg.layers):
        ks: list[list[str]] = [[] for _ in range(G)]
        vs: list[list[str]] = [[] for _ in range(G)]
        last = li == b.cfg.layers - 1
        for t, (r0, r) in enumerate(spans):
            stem = f"l{li}.t{t}"
            # key tiles wholly before the window of the tile's first row are not read
            first = next(n for n, (k0, kr) in enumerate(spans) if k0 + kr > b.layer.spec.first_key(li, r0))
            attend = _tile_attend(b, li, stem, ks, vs, (r0, r, first, spans[first][0]), block if cache else 0)
            # the last layer of a tile whose logits nobody wants only gives the cache its k, v
            needed = not (last and logits == "last" and t < n - 1)
            h1 = b.layer.attention_block(li, h[t], cos[t], sin[t], stem, t % G, attend, needed)
            if h1:
                h[t] = b.layer.mlp_block(li, h1, t % G, stem, last)
    out = []
    for t, (r0, _) in enumerate(spans):
        if logits == "all" or t == n - 1:
            out.append((r0, b.head(h[t][0], t % G, f"t{t}")))
    return ModelGraph("prefill", g, rows, block, blocks, b.dtype, out, b.split, spans)


def _tile_attend(
    b: _Builder,
    li: int,
    stem: str,
    ks: list[list[str]],
    vs: list[list[str]],
    tile: tuple[int, int, int, int],
    cache: int,
) -> Attend:
    """The attention of layer li's prefill tile `tile` = (r0, rows, n0, k0), rows r0..r0+rows,
    over the keys and values of the tiles from tile n0 (its first row k0) up to it (`ks`, `vs` per
    GPU: every tile's, this one's appended), carried into KV cache blocks of `cache` rows (0: no
    cache)."""
    r0, rows, n0, k0 = tile

    def attend(j: int, q: str, k: str, v: str) -> str:
        ks[j].append(k)
        vs[j].append(v)
        for x, c in ((k, "k"), (v, "v")) if cache else ():
            # an int8 cache stores packed rows; the tiles' attention reads the floats
            _save_blocks(
                b.g, kv_rows(b.g, b.ck.kv_cache, x, f"{stem}.{c}q_g{j}"), f"{c}c.l{li}", r0, rows, cache, j
            )
        return q and b.layer.attention(q, ks[j][n0:], vs[j][n0:], f"{stem}.attn_g{j}", r0 - k0, li)

    return attend


def first_block(spec: LayerSpec, li: int, blocks: int, block: int) -> int:
    """The first KV cache block of layer li that a decode step of the bucket `blocks` (positions
    from (blocks-1)*block) reads: the blocks before it lie wholly outside its window."""
    return spec.first_key(li, (blocks - 1) * block) // block


def behind_window(cfg: ModelConfig, gpus: int, p: int, block: int, first: bool) -> list[str]:
    """The KV cache states that the decode step at position p and every later one never read
    (blocks wholly behind each layer's window) and the step before read (all such blocks at a
    generation's `first` step): what the workers may drop before it runs."""
    spec, now = cfg.spec, p // block + 1
    return [
        f"{c}c.l{li}.b{n}_g{j}"
        for li in range(cfg.layers)
        for n in range(
            0 if first else first_block(spec, li, (p - 1) // block + 1, block),
            first_block(spec, li, now, block),
        )
        for c in "kv"
        for j in range(gpus)
    ]


def _cached_attend(b: _Builder, li: int, stem: str, pos: list[str], blocks: int, block: int) -> Attend:
    """The attention of one token at run-time position pos over layer li's KV cache blocks
    first..blocks-1 (states; `first_block`), its key and value written into the last one."""
    g, cur, packing = b.g, blocks - 1, b.ck.kv_cache
    first = first_block(b.layer.spec, li, blocks, block)
    shape, dtype = cache_block(packing, block, b.split.kv_heads * b.cfg.head_dim, b.dtype)

    def attend(j: int, q: str, k: str, v: str) -> str:
        kc, vc = (
            [g.input(f"{c}c.l{li}.b{n}_g{j}", shape, dtype, gpu=j, state=True) for n in range(first, blocks)]
            for c in "kv"
        )
        k, v = kv_rows(g, packing, k, f"{stem}.kq_g{j}"), kv_rows(g, packing, v, f"{stem}.vq_g{j}")
        kn = g.kernel("kv_write", kc[-1], k, pos[j], id=f"{stem}.kw_g{j}", start=cur * block)
        vn = g.kernel("kv_write", vc[-1], v, pos[j], id=f"{stem}.vw_g{j}", start=cur * block)
        g.save_state(kn, kc[-1])
        g.save_state(vn, vc[-1])
        kv = (*kc[:-1], kn, *vc[:-1], vn)
        attrs = b.layer.attention_attrs(li) | kv_attrs(packing)
        return g.kernel("attention_at", q, pos[j], *kv, id=f"{stem}.attn_g{j}", start=first * block, **attrs)

    return attend


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
    tok = [g.input(f"tok_g{j}", (1,), "int64", gpu=j) for j in range(G)]
    pos = [g.input(f"pos_g{j}", (1,), "int64", gpu=j) for j in range(G)]
    cos = [g.input(f"cos_g{j}", (1, hd), b.dtype, gpu=j) for j in range(G)]
    sin = [g.input(f"sin_g{j}", (1, hd), b.dtype, gpu=j) for j in range(G)]
    h = b.embed(tok, 0, "d")
    for li in range(cfg.layers):
        stem = f"d.l{li}"

        attend = _cached_attend(b, li, stem, pos, blocks, block)
        h1 = b.layer.attention_block(li, h, cos, sin, stem, 0, attend)
        h = b.layer.mlp_block(li, h1, 0, stem, li == cfg.layers - 1)
    return ModelGraph("decode", g, 1, block, blocks, b.dtype, [(0, b.head(h[0], 0, "d"))], s, [(0, 1)])
