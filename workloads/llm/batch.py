"""A batch of prompts of different lengths as TaskGraphs: ragged prefill and decode steps.

**Left-aligned cache index.** The prompts of a batch are LEFT-padded to a shared length L (a
multiple of `block`): row r's sequence occupies cache indices o_r..L-1 (o_r = L - its length), so
every row's current token sits at the same cache index p and the graph is static per (rows,
cache blocks). What differs per row is data, given at run time: its token, its rotary row (its
real position p - o_r) and its key span `[o_r, p]` (`attention_span`), which masks its padding
and the future. A padding query row (prefill, index < o_r) sees only itself: finite values that
no real row reads (a row attending to nothing would give NaN, and 0 * NaN leaks).

**Per-row KV cache states.** Row r has its own blocks `kc.r{r}.l{i}.b{n}_g{j}` (and `vc.`), so
a finished row's states are dropped and a live row's renamed to a lower row between runs
(`WorkerStore.move_states`), without copying the cache.

**Micro-batches.** `micro=m` splits the rows into m groups of rows/m; within each layer every
group passes the attention block, then every group the MLP block (FlexGen's zig-zag block
schedule over the batch), all reading the same weight inputs, so the plan keeps a weight in the
arena while the groups pass. Each group is a row tile of its own: its projections and MLP run
on its rows stacked, its attention per row (per sequence in prefill) over that row's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disco_ray.graph.errors import UsageError
from disco_ray.graph.taskgraph import Kind, TaskGraph

from .checkpoint import Checkpoint, ModelConfig
from .decode_sample import add_sampling
from .layer import Attend, rope_tables
from .model import ModelGraph, _Builder, first_block
from .packed import cache_block, kv_attrs, kv_rows


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where each row of a batch sits in the cache: row r's first token at `offsets[r]`, its last
    at `length` - 1 (every row's, left-aligned)."""

    block: int
    length: int  # L, a multiple of block
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, lengths: Sequence[int], block: int, rows: int | None = None) -> BatchLayout:
        """The layout of prompts of `lengths` in `rows` rows (default: one per prompt; the rows
        beyond the prompts are padding, a one-token prompt)."""
        rows = len(lengths) if rows is None else rows
        length = block * math.ceil(max(lengths) / block)
        return cls(block, length, tuple(length - n for n in lengths) + (length - 1,) * (rows - len(lengths)))

    @property
    def rows(self) -> int:
        return len(self.offsets)

    @property
    def blocks(self) -> int:
        return self.length // self.block

    def take(self, rows: Sequence[int | None]) -> BatchLayout:
        """The layout after compaction: new row i is old row rows[i] (None: padding)."""
        return BatchLayout(
            self.block, self.length, tuple(self.length - 1 if r is None else self.offsets[r] for r in rows)
        )


def micro_groups(rows: int, micro: int) -> list[range]:
    """The rows of each of `micro` micro-batches (contiguous, equal)."""
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1 or rows % micro:
        raise UsageError(f"micro must be a positive integer dividing the {rows} rows, got {micro!r}")
    n = rows // micro
    return [range(k * n, (k + 1) * n) for k in range(micro)]


class ZigZag:
    """The planner's serial order of a graph with micro-batches (FlexGen's zig-zag block
    schedule): within a block of a layer the micro-batches' vertices interleave step by step
    (norm of each, q projection of each, ...), so the uses of a weight are adjacent and the plan
    keeps it loaded while every micro-batch passes; a graph input comes right before its first user."""

    def __init__(self, g: TaskGraph):
        self.g = g
        self.segments: list[list[list[str]]] = []  # each: one vertex list per micro-batch
        self._mark = 0

    def take(self) -> list[str]:
        """The vertices added since the last `take`."""
        ids = list(self.g.vertices)
        got, self._mark = ids[self._mark :], len(ids)
        return got

    def add(self, per_micro: list[list[str]]) -> None:
        self.segments.append(per_micro)

    def order(self) -> list[str]:
        g, done, out = self.g, set(), []

        def emit(x: str) -> None:
            for y in g[x].inputs:
                if y not in done and g[y].kind is Kind.INPUT:
                    emit(y)
            if x not in done:
                done.add(x)
                out.append(x)

        for seg in self.segments:
            steps = [[x for x in part if g[x].kind is not Kind.INPUT] for part in seg]
            for i in range(max(map(len, steps), default=0)):
                for part in steps:
                    if i < len(part):
                        emit(part[i])
            for part in seg:  # inputs no vertex of the segment reads
                for x in part:
                    emit(x)
        for x in g.vertices:
            emit(x)
        return out


def _state(kind: str, row: int, li: int, blk: int, j: int) -> str:
    return f"{kind}c.r{row}.l{li}.b{blk}_g{j}"


def state_ids(cfg: ModelConfig, gpus: int, row: int, blocks: int) -> list[str]:
    """Every KV cache state of batch row `row` over `blocks` blocks, on every GPU."""
    return [
        _state(c, row, li, b, j)
        for li in range(cfg.layers)
        for b in range(blocks)
        for c in "kv"
        for j in range(gpus)
    ]


def batch_prefill_graph(
    ck: Checkpoint,
    gpus: int,
    rows: int,
    blocks: int,
    block: int,
    *,
    dtype: str | None = None,
    micro: int = 1,
    tile: int | None = None,
) -> ModelGraph:
    """`rows` left-padded prompts of `blocks` * `block` cache indices through the model in row
    tiles (each micro-batch's rows stacked in a tile), their keys and values carried into each
    row's KV cache blocks, the logits of each row's last index (its last token) out."""
    tile = block if tile is None else tile
    if tile < block or tile % block:
        raise UsageError(f"the prefill tile {tile} must be a multiple of the cache block {block}")
    groups = micro_groups(rows, micro)
    length = blocks * block
    spans = [(r0, min(tile, length - r0)) for r0 in range(0, length, tile)]
    b = _Builder(ck, gpus, dtype or ck.config.dtype)
    g, G, hd, n = b.g, gpus, b.cfg.head_dim, len(spans)

    def inputs(x: str, shape, dt: str) -> dict[tuple[int, int], list[str]]:
        return {
            (k, t): [g.input(f"{x}_m{k}_t{t}_g{j}", shape(len(grp) * r), dt, gpu=j) for j in range(G)]
            for k, grp in enumerate(groups)
            for t, (_, r) in enumerate(spans)
        }

    tok = inputs("tok", lambda r: (r,), "int64")
    cos = inputs("cos", lambda r: (r, hd), b.dtype)
    sin = inputs("sin", lambda r: (r, hd), b.dtype)
    span = inputs("span", lambda r: (r, 2), "int64")
    owner = {(k, t): (k * n + t) % G for k in range(len(groups)) for t in range(n)}
    h = {kt: b.embed(tok[kt], owner[kt], f"m{kt[0]}.t{kt[1]}") for kt in tok}
    zz = ZigZag(g)
    zz.add([zz.take()])
    for li in range(b.cfg.layers):
        last = li == b.cfg.layers - 1
        # [group][gpu][row] -> its blocks so far
        keys: list[list[list[list[str]]]] = [[[[] for _ in grp] for _ in range(G)] for grp in groups]
        vals: list[list[list[list[str]]]] = [[[[] for _ in grp] for _ in range(G)] for grp in groups]
        for t, (r0, r) in enumerate(spans):
            h1, steps = {}, []
            for k, grp in enumerate(groups):  # the attention block of every micro-batch, then the MLPs
                stem = f"l{li}.m{k}.t{t}"
                attend = _rows_attend(b, li, stem, grp, keys[k], vals[k], span[k, t], r0, r, block)
                # the last layer of a tile whose logits nobody wants only gives the cache its k, v
                got = b.layer.attention_block(
                    li, h[k, t], cos[k, t], sin[k, t], stem, owner[k, t], attend, not (last and t < n - 1)
                )
                if got:
                    h1[k] = got
                steps.append(zz.take())
            zz.add(steps)
            steps = []
            for k, got in h1.items():
                h[k, t] = b.layer.mlp_block(li, got, owner[k, t], f"l{li}.m{k}.t{t}", last)
                steps.append(zz.take())
            zz.add(steps)
    out = []
    t, (_, r) = n - 1, spans[-1]
    for k, grp in enumerate(groups):
        x = h[k, t][0]
        if r > 1:  # each row's last index: the last row of its block of the tile
            x = g.reshape(x, (len(grp), r, b.cfg.dim), id=f"m{k}.rows")
            x = g.slice(x, axis=1, start=r - 1, stop=r, id=f"m{k}.lastrow")
            x = g.reshape(x, (len(grp), b.cfg.dim), id=f"m{k}.last")
        out.append((grp[0], b.head(x, owner[k, t], f"m{k}")))
    zz.add([zz.take()])
    order = zz.order() if micro > 1 else []
    return ModelGraph("batch_prefill", g, rows, block, blocks, b.dtype, out, b.split, spans, order)


def _rows_attend(
    b: _Builder,
    li: int,
    stem: str,
    grp: range,
    keys: list[list[list[str]]],
    vals: list[list[list[str]]],
    span: list[str],
    r0: int,
    r: int,
    block: int,
) -> Attend:
    """Layer li's attention of a prefill tile (cache indices r0..r0+r) of the rows `grp`, stacked:
    each row's keys and values cut into its blocks and carried into its KV cache states, each
    row attending over its own blocks so far within its span."""
    g = b.g

    def cut(x: str, i: int, n: int) -> str:
        if len(grp) == 1 and r == block:
            return x
        s = i * r + n * block
        return g.slice(x, axis=0, start=s, stop=s + block, id=f"{x}.r{i}.b{n}")

    def attend(j: int, q: str, k: str, v: str) -> str:
        pk = b.ck.kv_cache  # an int8 cache stores packed rows; the tile's attention reads the floats
        kq, vq = kv_rows(g, pk, k, f"{stem}.kq_g{j}"), kv_rows(g, pk, v, f"{stem}.vq_g{j}")
        for i, row in enumerate(grp):
            for n in range(r // block):
                blk = r0 // block + n
                for x, xq, kind, kept in ((k, kq, "k", keys), (v, vq, "v", vals)):
                    part = cut(x, i, n)
                    g.save_state(part if xq == x else cut(xq, i, n), _state(kind, row, li, blk, j))
                    kept[j][i].append(part)
        if not q:
            return ""
        # blocks wholly before the window of the tile's first index are not read
        n0 = b.layer.spec.first_key(li, r0) // block
        kv = [x for row in keys[j] for x in row[n0:]] + [x for row in vals[j] for x in row[n0:]]
        attrs = b.layer.attention_attrs(li) | {"start": n0 * block}
        return g.kernel("attention_span", q, span[j], *kv, id=f"{stem}.attn_g{j}", groups=len(grp), **attrs)

    return attend


def batch_decode_graph(
    ck: Checkpoint,
    gpus: int,
    rows: int,
    blocks: int,
    block: int,
    *,
    dtype: str | None = None,
    micro: int = 1,
    stops: int = 0,
    logits: bool = False,
) -> ModelGraph:
    """One token per row at the shared run-time cache index p in [(blocks-1)*block,
    blocks*block), each row attending to its KV cache blocks 0..blocks-1 (states) within its
    span, its key and value written into its last block.

    `stops` = 0: the logits of each row are the outputs. `stops` = S > 0: the graph also chooses
    each row's next token on the device (`add_sampling`: S stop ids per row), and outputs the
    tokens and the rows' finished flags (the logits too when `logits`)."""
    groups = micro_groups(rows, micro)
    b = _Builder(ck, gpus, dtype or ck.config.dtype)
    g, cfg, G, hd = b.g, b.cfg, gpus, b.cfg.head_dim

    def inputs(x: str, k: int, shape, dt: str) -> list[str]:
        return [g.input(f"{x}_m{k}_g{j}", shape, dt, gpu=j) for j in range(G)]

    pos = [g.input(f"pos_g{j}", (1,), "int64", gpu=j) for j in range(G)]
    tok = [inputs("tok", k, (len(grp),), "int64") for k, grp in enumerate(groups)]
    cos = [inputs("cos", k, (len(grp), hd), b.dtype) for k, grp in enumerate(groups)]
    sin = [inputs("sin", k, (len(grp), hd), b.dtype) for k, grp in enumerate(groups)]
    span = [inputs("span", k, (len(grp), 2), "int64") for k, grp in enumerate(groups)]
    owner = [k % G for k in range(len(groups))]
    zz = ZigZag(g)
    h = []
    for k in range(len(groups)):
        h.append(b.embed(tok[k], owner[k], f"d.m{k}"))
    zz.add([zz.take()])
    for li in range(cfg.layers):
        last = li == cfg.layers - 1
        h1, steps = [], []
        for k, grp in enumerate(groups):  # the attention block of every micro-batch, then the MLPs
            stem = f"d.l{li}.m{k}"
            attend = _cached_rows_attend(b, li, stem, grp, pos, span[k], blocks, block)
            h1.append(b.layer.attention_block(li, h[k], cos[k], sin[k], stem, owner[k], attend))
            steps.append(zz.take())
        zz.add(steps)
        h, steps = [], []
        for k in range(len(groups)):
            h.append(b.layer.mlp_block(li, h1[k], owner[k], f"d.l{li}.m{k}", last))
            steps.append(zz.take())
        zz.add(steps)
    out: list[tuple[int, list[str]]] = []
    steps = []
    mgraph = ModelGraph("batch_decode", g, rows, block, blocks, b.dtype, out, b.split, [(0, rows)])
    for k, grp in enumerate(groups):
        out.append((grp[0], b.head(h[k][0], owner[k], f"d.m{k}", keep=logits or not stops)))
        if stops:
            add_sampling(mgraph, k, grp, owner[k], stops)
        steps.append(zz.take())
    zz.add(steps)
    mgraph.order = zz.order() if micro > 1 else []
    return mgraph


def _cached_rows_attend(
    b: _Builder, li: int, stem: str, grp: range, pos: list[str], span: list[str], blocks: int, block: int
) -> Attend:
    """The attention of the rows `grp` (one token each, at run-time index pos) over their own KV
    cache blocks of layer li from the first in the window (`first_block`), each row's key and
    value written into its last block."""
    g, cur, kv = b.g, blocks - 1, b.ck.kv_cache
    first = first_block(b.layer.spec, li, blocks, block)
    shape, dtype = cache_block(kv, block, b.split.kv_heads * b.cfg.head_dim, b.dtype)

    def attend(j: int, q: str, k: str, v: str) -> str:
        keys: list[str] = []
        vals: list[str] = []
        k, v = kv_rows(g, kv, k, f"{stem}.kq_g{j}"), kv_rows(g, kv, v, f"{stem}.vq_g{j}")  # int8: packed
        for i, row in enumerate(grp):
            for kind, new, kept in (("k", k, keys), ("v", v, vals)):
                cache = [
                    g.input(_state(kind, row, li, n, j), shape, dtype, gpu=j, state=True)
                    for n in range(first, blocks)
                ]
                wid, at = f"{stem}.{kind}w{i}_g{j}", cur * block
                w = g.kernel("kv_write", cache[-1], new, pos[j], id=wid, start=at, row=i)
                g.save_state(w, cache[-1])
                kept += [*cache[:-1], w]
        attrs = b.layer.attention_attrs(li) | {"start": first * block} | kv_attrs(kv)
        return g.kernel(
            "attention_span", q, span[j], *keys, *vals, id=f"{stem}.attn_g{j}", groups=len(grp), **attrs
        )

    return attend


def feed_prefill(
    mgraph: ModelGraph, cfg: ModelConfig, layout: BatchLayout, prompts: Sequence[Sequence[int]], micro: int
) -> dict[str, torch.Tensor]:
    """The caller inputs of a batch prefill: row r's prompt left-padded (token 0) to the layout's
    length; rows beyond the prompts are padding."""
    L, R, G = layout.length, layout.rows, mgraph.taskgraph.gpus
    tok = torch.zeros(R, L, dtype=torch.int64)
    for r, ids in enumerate(prompts):
        tok[r, layout.offsets[r] :] = torch.tensor(list(ids), dtype=torch.int64)
    off = torch.tensor(layout.offsets, dtype=torch.int64).unsqueeze(1)  # [R, 1]
    idx = torch.arange(L, dtype=torch.int64).unsqueeze(0)  # [1, L]
    cos, sin = rope_tables(cfg.spec, (idx - off).clamp(min=0).reshape(-1), getattr(torch, mgraph.dtype))
    cos, sin = cos.view(R, L, -1), sin.view(R, L, -1)
    span = torch.stack((off.expand(R, L), idx.expand(R, L)), dim=-1)  # [R, L, 2]: (o_r, index)
    out: dict[str, torch.Tensor] = {}
    for k, grp in enumerate(micro_groups(R, micro)):
        rows = slice(grp.start, grp.stop)
        for t, (r0, r) in enumerate(mgraph.tiles):
            cols = slice(r0, r0 + r)
            part = {
                "tok": tok[rows, cols].reshape(-1),
                "cos": cos[rows, cols].reshape(-1, cos.shape[-1]),
                "sin": sin[rows, cols].reshape(-1, sin.shape[-1]),
                "span": span[rows, cols].reshape(-1, 2),
            }
            for j in range(G):
                out |= {f"{x}_m{k}_t{t}_g{j}": v.clone() for x, v in part.items()}
    return out


def feed_decode(
    mgraph: ModelGraph, cfg: ModelConfig, layout: BatchLayout, tokens: Sequence[int], p: int, micro: int
) -> dict[str, torch.Tensor]:
    """The caller inputs of a batch decode step: row r's token at cache index p (position p - o_r)."""
    G, R = mgraph.taskgraph.gpus, layout.rows
    off = torch.tensor(layout.offsets, dtype=torch.int64)
    cos, sin = rope_tables(cfg.spec, (p - off).clamp(min=0), getattr(torch, mgraph.dtype))
    tok = torch.tensor(list(tokens) + [0] * (R - len(tokens)), dtype=torch.int64)
    span = torch.stack((off, torch.full_like(off, p)), dim=1)
    out = {f"pos_g{j}": torch.tensor([p], dtype=torch.int64) for j in range(G)}
    for k, grp in enumerate(micro_groups(R, micro)):
        rows = slice(grp.start, grp.stop)
        part = {"tok": tok[rows], "cos": cos[rows], "sin": sin[rows], "span": span[rows]}
        for j in range(G):
            out |= {f"{x}_m{k}_g{j}": v.clone() for x, v in part.items()}
    return out
