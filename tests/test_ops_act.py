"""The ops Gemma 2 adds, against torch: gelu_tanh and softcap with their backward against autograd,
rmsnorm's weight offset against transformers' Gemma2RMSNorm, the embedding scale, and attention's
soft-capped scores (every forward op and the tiled backward) against a plain torch reference and
its autograd; the refusals of bad attributes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_ops_train import DTYPES, _close, _grad, _randn, _run, _starts


def _cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_its_grad_are_torch_gelu_tanh_and_autograd(dtype):
    g = torch.Generator().manual_seed(40)
    a, dh = _randn(6, 24, g=g, dtype=dtype) * 3, _randn(6, 24, g=g, dtype=dtype)
    torch.testing.assert_close(_run("gelu_tanh", [a]), F.gelu(a, approximate="tanh"), atol=0, rtol=0)
    (want,) = _grad(lambda a: F.gelu(a, approximate="tanh"), a, dy=dh)
    _close(_run("gelu_tanh_grad", [a, dh]), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_and_its_grad_from_the_capped_values(dtype):
    g = torch.Generator().manual_seed(41)
    x, dy = _randn(5, 32, g=g, dtype=dtype) * 20, _randn(5, 32, g=g, dtype=dtype)
    y = _run("softcap", [x], cap=7.5)
    torch.testing.assert_close(y, _cap(x, 7.5), atol=0, rtol=0)  # transformers' order of operations
    assert y.abs().max() <= 7.5
    (want,) = _grad(lambda x: _cap(x, 7.5), x, dy=dy)
    _close(_run("softcap_grad", [y, dy], cap=7.5), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_offset_is_gemma2_rmsnorm_and_its_grad_autograd(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    g = torch.Generator().manual_seed(42)
    x, w, dy = (
        _randn(3, 4, 16, g=g, dtype=dtype),
        _randn(16, g=g, dtype=dtype),
        _randn(3, 4, 16, g=g, dtype=dtype),
    )
    norm = Gemma2RMSNorm(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        want = norm(x)
    _close(_run("rmsnorm", [x, w], eps=1e-6, offset=1.0), want.float(), dtype)
    (dwant,) = _grad(lambda x: F.rms_norm(x, (16,), None, 1e-6) * (1 + w.float()), x, dy=dy)
    _close(_run("rmsnorm_grad", [x, w, dy], eps=1e-6, offset=1.0), dwant, dtype)


def test_embedding_scale_multiplies_the_rows_looked_up():
    table = torch.randn(10, 4, generator=torch.Generator().manual_seed(43))
    ids = torch.tensor([3, 12, 7])
    got = _run("embedding", [ids, table], start=2, scale=8.0)
    torch.testing.assert_close(got, torch.stack([table[1], torch.zeros(4), table[5]]) * 8.0)


def _ref(q, k, v, heads, kv_heads, scale, cap, mask):
    """Gemma 2's eager attention: scores scaled, capped, masked, softmax in float32, times v."""
    t, s = q.shape[0], k.shape[0]
    qh = q.view(t, heads, -1).transpose(0, 1)
    kh = k.view(s, kv_heads, -1).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    vh = v.view(s, kv_heads, -1).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    scores = _cap((qh @ kh.transpose(1, 2)) * scale, cap).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1).reshape(t, -1)


@pytest.mark.parametrize("heads, kv_heads, t", [(4, 2, 3), (4, 4, 12), (8, 1, 2)])
def test_every_attention_forward_caps_its_scores(heads, kv_heads, t):
    g = torch.Generator().manual_seed(44)
    s, d, scale, cap = 12, 8, 0.9, 2.0
    q = _randn(t, heads * d, g=g) * 3
    k, v = _randn(s, kv_heads * d, g=g) * 3, _randn(s, kv_heads * d, g=g)
    off = s - t
    mask = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + off
    want = _ref(q, k, v, heads, kv_heads, scale, cap, mask)
    attrs = dict(heads=heads, kv_heads=kv_heads, scale=scale, softcap=cap)
    kv = [*k.split(4), *v.split(4)]
    torch.testing.assert_close(_run("attention", [q, *kv], offset=off, **attrs), want)
    at = _run("attention_at", [q, torch.tensor([off]), *kv], **attrs)
    torch.testing.assert_close(at, want)
    span = torch.stack((torch.zeros(t, dtype=torch.int64), torch.arange(t) + off), 1)
    torch.testing.assert_close(_run("attention_span", [q, span, *kv], **attrs), want)
    uncapped = _run("attention", [q, *kv], offset=off, heads=heads, kv_heads=kv_heads, scale=scale)
    assert not torch.allclose(uncapped, want, atol=1e-3)  # the cap matters at these scores


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])
def test_tiled_attention_backward_with_capped_scores_equals_autograd(heads, kv_heads):
    g = torch.Generator().manual_seed(45)
    tiles, d, scale, cap = (4, 4, 4), 8, 0.9, 2.0
    n = sum(tiles)
    q, do = _randn(n, heads * d, g=g) * 3, _randn(n, heads * d, g=g)
    k, v = _randn(n, kv_heads * d, g=g) * 3, _randn(n, kv_heads * d, g=g)
    mask = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    want_q, want_k, want_v = _grad(
        lambda q, k, v: _ref(q, k, v, heads, kv_heads, scale, cap, mask), q, k, v, dy=do
    )
    ks, vs = list(k.split(tiles)), list(v.split(tiles))
    attrs = dict(heads=heads, kv_heads=kv_heads, scale=scale, softcap=cap)
    dqs, dkv = [], torch.zeros(n, 2 * kv_heads * d)
    for i, q0 in enumerate(_starts(tiles)):
        qi, doi = q[q0 : q0 + tiles[i]], do[q0 : q0 + tiles[i]]
        kv = ks[: i + 1] + vs[: i + 1]
        oi = _run("attention", [qi, *kv], offset=q0, **attrs)
        stats = _run("attention_stats", [qi, *kv, oi, doi], offset=q0, **attrs)
        dqs.append(_run("attention_grad_q", [qi, stats, doi, *kv], offset=q0, **attrs))
        for j, k0 in enumerate(_starts(tiles)[: i + 1]):
            part = _run(
                "attention_grad_kv", [qi, stats, doi, ks[j], vs[j]], q_offset=q0, k_offset=k0, **attrs
            )
            dkv[k0 : k0 + tiles[j]] += part
    # the cap's derivative from the capped scores rounds apart from autograd's: 1e-4 relative
    for got, want, what in ((torch.cat(dqs), want_q, "dq"), (dkv[:, : kv_heads * d], want_k, "dk")):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m, w=what: f"{w}: {m}")
    _close(dkv[:, kv_heads * d :], want_v, torch.float32, "dv")


@pytest.mark.parametrize(
    "op, ins, attrs, message",
    [
        ("softcap", [(2, 3)], {"cap": 0.0}, "cap must be a positive finite number"),
        ("softcap_grad", [(2, 3), (2, 4)], {"cap": 1.0}, "different shapes"),
        (
            "attention",
            [(2, 8), (2, 8), (2, 8)],
            {"heads": 1, "scale": 1.0, "softcap": -2.0},
            "softcap must be",
        ),
        ("rmsnorm", [(2, 8), (8,)], {"offset": "1"}, "offset must be a finite number"),
    ],
)
def test_bad_attributes_are_refused_naming_them(op, ins, attrs, message):
    from disco_ray.graph import ops

    spec = ops.OPS[op]
    with pytest.raises(ValueError, match=message):
        full = spec.full_attrs(attrs)
        spec.infer(ins, ["float32"] * len(ins), full)
