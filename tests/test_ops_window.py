"""Sliding-window attention (the ops' `window` attribute) against torch: a query at position p
sees keys in (p - window, p]. Prefill tiles, a decode step's cache from its first block (`start`),
ragged batch rows, and the tiled backward against autograd of whole windowed attention, each
reading only the key tiles that reach into the window; the flop counts count the pairs seen."""

from __future__ import annotations

import pytest
import torch

from disco_ray.graph import ops
from disco_ray.graph.dtypes import from_torch
from disco_ray.graph.kernels import run_kernel
from disco_ray.graph.ops_llm import window_pairs

HEADS, D, SCALE = 4, 8, 0.35


def _run(op: str, ins: list[torch.Tensor], **attrs) -> torch.Tensor:
    """Runs `op` into a NaN-filled tensor of the inferred shape (every element must be written)."""
    spec = ops.OPS[op]
    full = spec.full_attrs(attrs)
    shape, dtype = spec.infer([tuple(x.shape) for x in ins], [from_torch(x.dtype) for x in ins], full)
    out = torch.full(shape, float("nan"), dtype=getattr(torch, dtype))
    run_kernel(op, out, ins, attrs)
    return out


def _mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    """[t, s]: key position kpos[c] seen by query position qpos[r] (transformers' sliding window)."""
    q, k = qpos[:, None], kpos[None, :]
    return (k <= q) & (k > q - window)


def _ref(q, k, v, kvh, mask):
    t, s = q.shape[0], k.shape[0]
    qh = q.view(t, HEADS, -1).transpose(0, 1)
    kh = k.view(s, kvh, -1).transpose(0, 1).repeat_interleave(HEADS // kvh, 0)
    vh = v.view(s, kvh, -1).transpose(0, 1).repeat_interleave(HEADS // kvh, 0)
    p = ((qh @ kh.transpose(1, 2)) * SCALE).masked_fill(~mask, float("-inf")).softmax(-1)
    return (p @ vh).transpose(0, 1).reshape(t, -1)


def _qkv(n: int, kvh: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, x * D, generator=g) for x in (HEADS, kvh, kvh))


@pytest.mark.parametrize("kvh", [4, 2])
@pytest.mark.parametrize("window", [1, 3, 5, 9])
def test_a_prefill_tile_over_the_key_tiles_in_its_window_is_windowed_attention(kvh, window):
    q, k, v = _qkv(16, kvh, 1)
    want = _ref(q, k, v, kvh, _mask(torch.arange(16), torch.arange(16), window))
    for r0 in (0, 4, 8, 12):  # query tiles of 4; the key tiles of 4 from the first the window reaches
        n0 = max(0, r0 - window + 1) // 4
        kv = [*k[4 * n0 : r0 + 4].split(4), *v[4 * n0 : r0 + 4].split(4)]
        got = _run("attention", [q[r0 : r0 + 4], *kv], heads=HEADS, kv_heads=kvh, scale=SCALE,
                   offset=r0 - 4 * n0, window=window)  # fmt: skip
        torch.testing.assert_close(got, want[r0 : r0 + 4], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", [8, 10, 11])
def test_a_decode_step_over_its_cache_from_the_first_block_is_windowed_attention(pos):
    q, k, v = _qkv(12, 2, 2)
    window, start = 5, 4  # positions 8..11 read blocks 1 and 2 (keys from 4)
    p = torch.tensor([pos])
    got = _run("attention_at", [q[pos : pos + 1], p, *k[start:].split(4), *v[start:].split(4)],
               heads=HEADS, kv_heads=2, scale=SCALE, start=start, window=window)  # fmt: skip
    want = _ref(q[pos : pos + 1], k, v, 2, _mask(torch.tensor([pos]), torch.arange(12), window))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_ragged_rows_see_their_span_within_the_window():
    gen = torch.Generator().manual_seed(3)
    groups, t, kvh, window, start = 2, 3, 2, 4, 4
    q = torch.randn(groups * t, HEADS * D, generator=gen)
    k, v = torch.randn(groups, 12, kvh * D, generator=gen), torch.randn(groups, 12, kvh * D, generator=gen)
    # (first index of the row's sequence, the query's index); row 2 is padding (an empty span)
    span = torch.tensor([[5, 11], [0, 9], [10, 7], [2, 10], [6, 6], [0, 8]])
    ks = [x for g in range(groups) for x in k[g, start:].split(4)]
    vs = [x for g in range(groups) for x in v[g, start:].split(4)]
    got = _run("attention_span", [q, span, *ks, *vs], heads=HEADS, kv_heads=kvh, scale=SCALE,
               groups=groups, start=start, window=window)  # fmt: skip
    keys = torch.arange(12)
    for r in range(groups * t):
        lo, hi = span[r].tolist()
        mask = (_mask(torch.tensor([hi]), keys, window) & (keys >= lo)) | (keys == hi)
        want = _ref(q[r : r + 1], k[r // t], v[r // t], kvh, mask)
        torch.testing.assert_close(got[r : r + 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kvh", [4, 2])
@pytest.mark.parametrize("window", [2, 5])
def test_the_tiled_backward_over_the_tiles_in_the_window_is_autograd_of_windowed_attention(kvh, window):
    n, b = 12, 4
    q, k, v = _qkv(n, kvh, 4)
    do = torch.randn(n, HEADS * D, generator=torch.Generator().manual_seed(5))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    _ref(*leaves, kvh, _mask(torch.arange(n), torch.arange(n), window)).backward(do)
    attrs = dict(heads=HEADS, kv_heads=kvh, scale=SCALE, window=window)
    dq, dkv = [], torch.zeros(n, 2 * kvh * D)
    for t in range(n // b):
        n0 = max(0, t * b - window + 1) // b  # the key tiles the train graph reads
        qi, doi = q[t * b : (t + 1) * b], do[t * b : (t + 1) * b]
        kk, vv = k[n0 * b : (t + 1) * b].split(b), v[n0 * b : (t + 1) * b].split(b)
        oi = _run("attention", [qi, *kk, *vv], offset=(t - n0) * b, **attrs)
        st = _run("attention_stats", [qi, *kk, *vv, oi, doi], offset=(t - n0) * b, **attrs)
        dq.append(_run("attention_grad_q", [qi, st, doi, *kk, *vv], offset=(t - n0) * b, **attrs))
        for i, m in enumerate(range(n0, t + 1)):
            part = _run(
                "attention_grad_kv", [qi, st, doi, kk[i], vv[i]], q_offset=t * b, k_offset=m * b, **attrs
            )
            dkv[m * b : (m + 1) * b] += part
    torch.testing.assert_close(torch.cat(dq), leaves[0].grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dkv[:, : kvh * D], leaves[1].grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dkv[:, kvh * D :], leaves[2].grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "t, keys, offset, window", [(4, 12, 8, 5), (4, 8, 4, 1), (3, 9, 2, 20), (5, 6, -2, 3)]
)
def test_the_flops_count_the_pairs_in_the_window(t, keys, offset, window):
    seen = _mask(torch.arange(t) + offset, torch.arange(keys), window).sum().item()
    assert window_pairs(t, keys, offset, True, window) == seen
    assert (
        window_pairs(t, keys, offset, True, 0)
        == (torch.arange(keys)[None] <= torch.arange(t)[:, None] + offset).sum()
    )


def test_a_bad_window_is_refused_naming_it():
    for op, ins in (
        ("attention", [(4, 32), (4, 16), (4, 16)]),
        ("attention_at", [(1, 32), (1,), (4, 16), (4, 16)]),
    ):
        dts = ["float32", *(["int64"] if op == "attention_at" else []), "float32", "float32"]
        with pytest.raises(ValueError, match="window must be an integer >= 0"):
            spec = ops.OPS[op]
            spec.infer(ins, dts, spec.full_attrs({"heads": 4, "kv_heads": 2, "scale": 1.0, "window": -1}))
