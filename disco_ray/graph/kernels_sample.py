"""Choosing tokens from logits, as kernels: the math `disco_ray.models.sampling` uses on the driver
and the ops `sample_tokens` and `finished_rows` (`ops_llm`) run on the device that holds the logits.

`process_rows` applies temperature, then top-k, then top-p, with transformers' warpers' semantics;
`pick` draws one token per row by the inverse CDF of softmax(process_rows) at a given uniform u
(greedy: argmax, the lowest id among ties). A row's token depends on its own logits and u only,
so the driver (one u per sequence from its `SequenceSampler`) and a kernel (the same u handed in
as a tensor) choose the same tokens. Like `kernels_llm`, this module imports nothing of the project.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

PADDING = -1.0  # u of a row that holds no sequence: its token is 0 and its logits are not looked at


def process_rows(x: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p of float32 rows [batch, vocab]; filtered tokens -inf.

    A new tensor; every row independently of the others (top-k keeps every token tied with the
    k-th; top-p keeps the most likely token always, min_tokens_to_keep=1)."""
    x = x / temperature if temperature != 1.0 else x.clone()
    if top_k:
        kth = torch.topk(x, min(top_k, x.shape[1]), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        # ascending order, as the warper sorts (torch.sort's order also decides between ties)
        ascending, order = torch.sort(x, dim=-1)
        drop_sorted = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop_sorted[:, -1] = False
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    return x


def pick(
    logits: torch.Tensor, u: torch.Tensor | None, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """The token of each row [batch] int64: argmax when `u` is None (greedy), else the inverse CDF
    of softmax(process_rows) at u [batch] (float64 in [0, 1)), in float64."""
    x = logits.to(torch.float32)
    if u is None:
        return x.argmax(dim=-1)
    probs = process_rows(x, temperature, top_k, top_p).softmax(dim=-1)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    picked = torch.searchsorted(cdf, u.to(torch.float64).reshape(-1, 1) * cdf[:, -1:], right=True)
    # u * total may round up to total: fall back to the row's last token of nonzero probability
    last = probs.shape[1] - 1 - (probs > 0).flip(-1).to(torch.int64).argmax(dim=-1, keepdim=True)
    return torch.minimum(picked, last).squeeze(1)


def as_bits(x: torch.Tensor) -> torch.Tensor:
    """float64 values as the int64 tensor of their bits: how u and params travel (graphs hold no
    float64), exactly."""
    return x.to(torch.float64).contiguous().view(torch.int64)


def sample_tokens(out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
    """Kernel of `sample_tokens`: logits [rows, vocab], u [rows] (float64 bits, `as_bits`; PADDING:
    no sequence), params [3] (float64 bits: temperature, 0 for greedy; top_k; top_p) -> tokens
    [rows] int64."""
    logits, u, params = ins[0], ins[1].view(torch.float64), ins[2].view(torch.float64)
    temperature, top_k, top_p = params.tolist()
    live = (u >= 0).nonzero().reshape(-1)
    rows = logits.index_select(0, live)
    bad = (~torch.isfinite(rows)).any(dim=-1)
    if bool(bad.any()):  # one host sync: a NaN row would sample garbage without a word
        i = int(bad.nonzero()[0, 0])
        x = rows[i]
        raise ValueError(
            f"non-finite logits in row {int(live[i])}: {int(torch.isnan(x).sum())} NaN and "
            f"{int(torch.isinf(x).sum())} infinite values of {x.numel()} (the model's output is broken)"
        )
    got = pick(rows, None if temperature == 0 else u.index_select(0, live), temperature, int(top_k), top_p)
    out.zero_()
    out.index_copy_(0, live, got)


def finished_rows(out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
    """Kernel of `finished_rows`: tokens [rows], stop ids [rows, S] (-1: none), left [rows] (the
    new tokens a row may still make, this one included; 0: no sequence) -> 1 where a live row's
    token is one of its stop ids or its last, else 0 [rows] int64."""
    tok, stop, left = ins
    hit = (stop == tok.reshape(-1, 1)).any(dim=-1) | (left == 1)
    out.copy_(hit & (left > 0))


KERNELS = {"sample_tokens": sample_tokens, "finished_rows": finished_rows}


def _sample_temps(out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> int:
    rows, vocab = ins[0].shape
    # the live rows' copy, the processed rows, sort values and order, softmax, float64 cdf, masks
    return rows * vocab * (4 * 4 + 8 + 8 + 8 + 3) + 64 * rows


def _finished_temps(out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> int:
    return ins[1].numel() + 4 * ins[0].numel()  # the compare and the row flags


TEMPS = {"sample_tokens": _sample_temps, "finished_rows": _finished_temps}
