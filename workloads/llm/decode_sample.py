"""A batch decode step that chooses its tokens on the device (`batch_decode_graph(stops=S)`), and
what runs several such steps in one call (`Program.run_steps`) needs: the inputs of each step's
sampling (`feed_sampling`) and the carry of each step's tokens into the next (`token_carry`).

Each micro-batch's logits are gathered on the GPU that owns the micro-batch (one transfer per
other GPU's column block), where `sample_tokens` picks each row's token with the draw u the
driver took from that row's sequence's sampler, so the tokens are those `sampling.sample` would
choose on the driver; `finished_rows` flags the rows whose token ends them (a stop id, or their
last new token), and any flag ends a `run_steps` call after that step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from disco_ray.graph.kernels_sample import as_bits

from .checkpoint import ModelConfig
from .layer import rope_tables
from .model import ModelGraph


def add_sampling(mgraph: ModelGraph, k: int, grp: range, owner: int, stops: int) -> None:
    """Micro-batch k's next tokens chosen on GPU `owner`: its logits' column blocks gathered there
    (a transfer from each other GPU), `sample_tokens` with the inputs `u_m{k}` (each row's draw)
    and `samp_m{k}` (temperature, top-k, top-p), then `finished_rows` with `stop_m{k}` ([rows, S]
    stop ids) and `left_m{k}` (the new tokens each row may still make): outputs `next_m{k}`, the
    tokens, and `done_m{k}`, the finished flags (the halt of `Program.run_steps`)."""
    g, n = mgraph.taskgraph, len(grp)
    parts = [
        x if g[x].gpu == owner else g.transfer(x, owner, id=f"{x}_to{owner}") for x in mgraph.logits[k][1]
    ]
    full = parts[0] if len(parts) == 1 else g.kernel("concat", *parts, id=f"d.m{k}.logits", gpu=owner, axis=1)
    u = g.input(f"u_m{k}", (n,), "int64", gpu=owner)  # float64 bits (`kernels_sample.as_bits`)
    params = g.input(f"samp_m{k}", (3,), "int64", gpu=owner)
    tok = g.kernel("sample_tokens", full, u, params, id=f"next_m{k}", gpu=owner)
    stop = g.input(f"stop_m{k}", (n, stops), "int64", gpu=owner)
    left = g.input(f"left_m{k}", (n,), "int64", gpu=owner)
    done = g.kernel("finished_rows", tok, stop, left, id=f"done_m{k}", gpu=owner)
    g.output(tok, done)
    mgraph.tokens.append((grp[0], tok))
    mgraph.finished.append(done)


def token_carry(mgraph: ModelGraph) -> dict[str, list[str]]:
    """What a sampling decode step hands the next (`Program.run_steps`' carry): each micro-batch's
    tokens `next_m{k}` become its token inputs `tok_m{k}_g{j}` on every GPU."""
    G = mgraph.taskgraph.gpus
    return {tok: [f"tok_m{k}_g{j}" for j in range(G)] for k, (_, tok) in enumerate(mgraph.tokens)}


def feed_sampling(
    mgraph: ModelGraph,
    u: torch.Tensor,
    left: torch.Tensor,
    params: torch.Tensor | None = None,
    stops: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The sampling inputs of one step of a sampling decode graph, per row: `u` [R] float64 (the
    row's draw; `kernels_sample.PADDING` for a row with no sequence), `left` [R] int64 (new tokens
    it may still make, this one included; 0 for padding); `params` [3] float64 (temperature, 0 for
    greedy; top_k; top_p) and `stops` [R, S] int64 (-1 padded), which a later step of the same
    `run_steps` call may leave out (the worker keeps them)."""
    out: dict[str, torch.Tensor] = {}
    n = mgraph.rows // len(mgraph.tokens)  # rows per micro-batch
    for k, (r0, _) in enumerate(mgraph.tokens):
        rows = slice(r0, r0 + n)
        out[f"u_m{k}"] = as_bits(u[rows])
        out[f"left_m{k}"] = left[rows].clone()
        if params is not None:
            out[f"samp_m{k}"] = as_bits(params)
        if stops is not None:
            out[f"stop_m{k}"] = stops[rows].clone()
    return out


def feed_decode_steps(
    mgraph: ModelGraph, cfg: ModelConfig, offsets: Sequence[int], tokens: Sequence[int], p: int, k: int
) -> list[dict[str, torch.Tensor]]:
    """`feed_decode`'s inputs of k decode steps at cache indices p..p+k-1 (the rotary rows of
    every step in one table) for rows whose first tokens sit at `offsets` (`BatchLayout.offsets`),
    `tokens` fed at the first step; the later steps have no token inputs (`token_carry` gives them)."""
    G, R = mgraph.taskgraph.gpus, len(offsets)
    n = R // len(mgraph.tokens)  # rows per micro-batch
    off = torch.tensor(list(offsets), dtype=torch.int64)
    idx = torch.arange(p, p + k, dtype=torch.int64).unsqueeze(1)  # [k, 1]
    cos, sin = rope_tables(cfg.spec, (idx - off).clamp(min=0).reshape(-1), getattr(torch, mgraph.dtype))
    cos, sin = cos.view(k, R, -1), sin.view(k, R, -1)
    tok = torch.tensor(list(tokens) + [0] * (R - len(tokens)), dtype=torch.int64)
    feeds = []
    for j in range(k):
        span = torch.stack((off, torch.full_like(off, p + j)), dim=1)
        out = {f"pos_g{g}": torch.tensor([p + j], dtype=torch.int64) for g in range(G)}
        for m, (r0, _) in enumerate(mgraph.tokens):
            rows = slice(r0, r0 + n)
            part = {"cos": cos[j, rows], "sin": sin[j, rows], "span": span[rows]}
            if j == 0:
                part["tok"] = tok[rows]
            for g in range(G):
                out |= {f"{x}_m{m}_g{g}": v.clone() for x, v in part.items()}
        feeds.append(out)
    return feeds
