"""LLaMA first-token inference (prefill) of decoder layers, tensor-parallel and sequence-tiled.

The layers are those of LLaMA (Touvron et al., 2023): RMSNorm with weight, Q/K/V projections,
rotary embedding, causal attention, output projection, SwiGLU MLP, residual adds. Heads and the MLP's
hidden units are split over G GPUs (Megatron-style): each GPU computes a partial output projection
and a partial down projection, which are moved to the tile's owner GPU (t mod G) and summed with the
residual there, and the sum is sent back to every GPU. The sequence is cut into query tiles of
`tile` rows; each attention vertex scores one query tile against the key/value tiles up to it, so
scores never exceed [heads/G, tile, seq]. Weights are random (no downloads). The layers are
built by the checkpoint models' layer builder (`workloads.llm.layer`) from this workload's
`layer_spec`; the plain torch reference below is independent of it.

The TaskGraph is built tile-major within each layer, which is also the serial order `order()`
gives the planner: projections of tile t, its attention (keys of tiles <= t exist by then), its MLP;
with `lookahead` k the attention of tile t + k comes before the MLP of tile t, which gives an order
that is run as is (the deterministic ablation) work to do while a tile's partial sums move.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from disco_ray.graph.dtypes import torch_dtype
from disco_ray.graph.errors import UsageError
from disco_ray.graph.taskgraph import TaskGraph

from . import Workload
from .llm.layer import Layer, LayerSpec, LayerWeights, Layout, Order, Split, rope_tables

EPS = 1e-6  # LLaMA's norm_eps
THETA = 10000.0  # rotary base

PRESETS: dict[str, dict] = {
    "tiny": dict(layers=2, gpus=2, seq=64, dim=64, heads=4, ffn=128, tile=16, dtype="float32"),
    "7b": dict(layers=32, gpus=4, seq=1024, dim=4096, heads=32, ffn=11008, tile=512, dtype="float16"),
    "65b": dict(layers=80, gpus=8, seq=1024, dim=8192, heads=64, ffn=22016, tile=512, dtype="float16"),
}
WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w1", "w3", "w2")


def llama_prefill(
    layers: int | None = None,
    gpus: int | None = None,
    seq: int | None = None,  # prompt length
    dim: int | None = None,  # model width
    heads: int | None = None,
    ffn: int | None = None,  # MLP hidden units
    tile: int | None = None,  # query/key tile rows
    dtype: str | None = None,
    seed: int = 0,
    preset: str = "tiny",  # tiny, 7b or 65b; explicit parameters override it
    lookahead: int = 0,  # lay out the attention of tile t + lookahead before the MLP of tile t
    materialize: bool = True,  # False: no input tensors (for planning and simulation only)
) -> Workload:
    """Builds `layers` LLaMA decoder layers for one prompt of `seq` tokens on `gpus` GPUs."""
    if preset not in PRESETS:
        raise UsageError(f"unknown llama preset {preset!r} (one of {', '.join(PRESETS)})")
    given = dict(layers=layers, gpus=gpus, seq=seq, dim=dim, heads=heads, ffn=ffn, tile=tile, dtype=dtype)
    p: dict[str, Any] = {k: PRESETS[preset][k] if v is None else v for k, v in given.items()}
    _check(p)
    if lookahead < 0:
        raise UsageError(f"llama_prefill: lookahead must be >= 0, got {lookahead}")
    g, levels, weights, layer_weights, outs = _graph(**p, lookahead=lookahead)
    inputs = _inputs(g, p, seed) if materialize else {}
    cfg = dict(p)

    def reference(ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tiles = cfg["seq"] // cfg["tile"]
        h = torch.cat([ins[f"h0_t{t}"] for t in range(tiles)], dim=0)
        cos, sin = rope_tables(
            layer_spec(cfg["dim"], cfg["heads"], cfg["ffn"]), torch.arange(cfg["seq"]), h.dtype
        )
        for names in layer_weights:
            h = llama_layer(h, full_weights(ins, names), cos, sin, cfg["heads"])
        return {o: h[t * cfg["tile"] : (t + 1) * cfg["tile"]] for t, o in enumerate(outs)}

    return Workload(
        "llama_prefill",
        g,
        inputs,
        reference,
        levels,
        weights,
        {**p, "seed": seed, "preset": preset, "lookahead": lookahead},
        {"layer_weights": layer_weights, "outputs": outs},
    )


def _check(p: dict) -> None:
    for k in ("layers", "gpus", "seq", "dim", "heads", "ffn", "tile"):
        if not isinstance(p[k], int) or p[k] < 1:
            raise UsageError(f"llama_prefill: {k} must be a positive integer, got {p[k]!r}")
    if p["dim"] % p["heads"] or (p["dim"] // p["heads"]) % 2:
        raise UsageError(f"llama_prefill: dim {p['dim']} must split into {p['heads']} heads of even size")
    if p["heads"] % p["gpus"] or p["ffn"] % p["gpus"]:
        raise UsageError(
            f"llama_prefill: heads {p['heads']} and ffn {p['ffn']} must divide by gpus {p['gpus']}"
        )
    if p["seq"] % p["tile"]:
        raise UsageError(f"llama_prefill: seq {p['seq']} is not a multiple of tile {p['tile']}")


def layer_spec(dim: int, heads: int, ffn: int) -> LayerSpec:
    """The workload's decoder layer: LLaMA's, with random weights stored [in, out] (`WEIGHTS`)."""
    hd = dim // heads
    spec = LayerSpec(
        dim, heads, None, hd, ffn, EPS, 1.0 / math.sqrt(hd), THETA, weights=LayerWeights(*WEIGHTS)
    )
    # the order and ids its plans were made with (see Order)
    return dataclasses.replace(spec, layout=Layout.IN_OUT, order=Order.BY_GPU, mlp_ids=("up1", "up3", "gate"))


def _graph(
    layers: int,
    gpus: int,
    seq: int,
    dim: int,
    heads: int,
    ffn: int,
    tile: int,
    dtype: str,
    lookahead: int = 0,
) -> tuple[TaskGraph, list[list[str]], list[str], list[dict[str, list[str]]], list[str]]:
    """The TaskGraph, its levels (one per layer), weight ids, per-layer weight ids and output ids."""
    G = gpus
    g = TaskGraph(G)
    spec = layer_spec(dim, heads, ffn)
    split = Split.of(spec, G)
    layer_weights: list[dict[str, list[str]]] = []
    lay = Layer(g, spec, split, lambda li, j: {r: layer_weights[li][n][j] for r, n in spec.weights.items()})
    # h[t][j]: the hidden state of tile t on GPU j; the prompt's embeddings start on the tile's owner
    tiles = range(seq // tile)
    h = [lay.broadcast(g.input(f"h0_t{t}", (tile, dim), dtype, gpu=t % G), f"h0_t{t}") for t in tiles]
    rot = [
        [g.input(f"{c}_t{t}_g{j}", (tile, spec.head_dim), dtype, gpu=j) for j in range(G)]
        for t in tiles
        for c in ("cos", "sin")
    ]
    starts = []  # where each layer's vertices start (level 0 has the inputs before it too)
    for li in range(layers):
        starts.append(len(g))
        layer_weights.append(
            {
                n: [g.input(f"l{li}.{n}_g{j}", split.block_shape(spec, r, j), dtype, gpu=j) for j in range(G)]
                for r, n in spec.weights.items()
            }
        )
        h = _layer(lay, li, h, rot[0::2], rot[1::2], tile, lookahead, li == layers - 1)
    order = list(g.vertices)
    bounds = [0, *starts[1:], len(order)]
    levels = [order[a:b] for a, b in itertools.pairwise(bounds)]
    weights = [x for w in layer_weights for ids in w.values() for x in ids]
    outs = [x[0] for x in h]
    g.output(*outs)
    return g, levels, weights, layer_weights, outs


def _layer(
    lay: Layer,
    li: int,
    h: list[list[str]],
    cos: list[list[str]],
    sin: list[list[str]],
    tile: int,
    lookahead: int,
    last: bool,
) -> list[list[str]]:
    """Adds layer `li` on hidden tiles h[t][gpu] tile by tile; returns the next layer's (the
    outputs, on each tile's owner, when `last`)."""
    G = lay.G
    ks: list[list[str]] = [[] for _ in range(G)]
    vs: list[list[str]] = [[] for _ in range(G)]

    def attention_block(t: int) -> list[str]:
        def attend(j: int, q: str, k: str, v: str) -> str:
            ks[j].append(k)  # keys of tiles <= t exist by now
            vs[j].append(v)
            return lay.attention(q, ks[j], vs[j], f"l{li}.t{t}.attn_g{j}", offset=t * tile)

        return lay.attention_block(li, h[t], cos[t], sin[t], f"l{li}.t{t}", t % G, attend)

    # software pipelining: the attention of tile t + lookahead is laid out before the MLP of tile t
    nxt: list[list[str]] = [[] for _ in h]
    h1s: dict[int, list[str]] = {}
    for t in range(len(h) + lookahead):
        if t < len(h):
            h1s[t] = attention_block(t)
        if t >= lookahead:
            u = t - lookahead
            nxt[u] = lay.mlp_block(li, h1s.pop(u), u % G, f"l{li}.t{u}", last)
    return nxt


def _inputs(g: TaskGraph, p: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dt = torch_dtype(p["dtype"])
    cos, sin = rope_tables(layer_spec(p["dim"], p["heads"], p["ffn"]), torch.arange(p["seq"]), dt)
    out: dict[str, torch.Tensor] = {}
    norms: dict[str, torch.Tensor] = {}  # every GPU gets the same copy of a norm weight
    for v in g.inputs():
        name = v.id
        if name.startswith(("cos_", "sin_")):
            t = int(name.split("_")[1][1:])
            table = cos if name.startswith("cos") else sin
            out[name] = table[t * p["tile"] : (t + 1) * p["tile"]].clone()
        elif "norm_g" in name:
            key = name.rsplit("_g", 1)[0]
            if key not in norms:
                norms[key] = (1 + 0.1 * torch.randn(v.shape, generator=gen)).to(dt)
            out[name] = norms[key].clone()
        elif name.startswith("h0_"):
            out[name] = torch.randn(v.shape, generator=gen).to(dt)
        else:
            out[name] = (torch.randn(v.shape, generator=gen) / math.sqrt(v.shape[0])).to(dt)
    return out


# ---- plain torch LLaMA (the reference and the baselines) --------------------------------------
def full_weights(ins: Mapping[str, torch.Tensor], names: Mapping[str, list[str]]) -> dict[str, torch.Tensor]:
    """A layer's whole weights from the per-GPU blocks (heads and MLP units in GPU order)."""
    out = {}
    for n, ids in names.items():
        blocks = [ins[i] for i in ids]
        if n.endswith("norm"):
            out[n] = blocks[0]
        else:
            out[n] = torch.cat(blocks, dim=0 if n in ("wo", "w2") else 1)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, seq, hd] rotated by position (rotate-half form)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def llama_layer(h: torch.Tensor, w: Mapping[str, torch.Tensor], cos, sin, heads: int) -> torch.Tensor:
    """One LLaMA decoder layer on h [seq, dim] with whole weights `w` (see `full_weights`)."""
    s, d = h.shape
    hd = d // heads
    x = rms_norm(h, w["attn_norm"])
    q, k, v = ((x @ w[n]).view(s, heads, hd).transpose(0, 1) for n in ("wq", "wk", "wv"))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # 4-d and in the weights' dtype, so that a GPU runs its fused (flash) kernel
    a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=1 / math.sqrt(hd))[0]
    h = h + a.transpose(0, 1).reshape(s, d) @ w["wo"]
    x = rms_norm(h, w["mlp_norm"])
    return h + (F.silu(x @ w["w1"]) * (x @ w["w3"])) @ w["w2"]
