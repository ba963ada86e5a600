"""The fused attention backward (`attention_grad`) against the two ops it fuses."""

from __future__ import annotations

import pytest
import torch

from disco_ray.graph import ops
from disco_ray.graph.dtypes import from_torch
from disco_ray.graph.kernels import run_kernel, temp_bytes

HEADS, D, B = 4, 8, 4  # heads, head width, rows per tile


def _run(op: str, ins: list[torch.Tensor], **attrs) -> torch.Tensor:
    """Runs `op` into a NaN-filled tensor of the inferred shape (every element must be written)."""
    spec = ops.OPS[op]
    shape, dtype = spec.infer(
        [tuple(x.shape) for x in ins], [from_torch(x.dtype) for x in ins], spec.full_attrs(attrs)
    )
    out = torch.full(shape, float("nan"), dtype=getattr(torch, dtype))
    run_kernel(op, out, ins, attrs)
    return out


@pytest.mark.parametrize(
    "kv_heads, window, softcap, tiles", [(4, 0, None, 1), (2, 0, None, 3), (1, 6, None, 3), (2, 0, 5.0, 2)]
)
def test_attention_grad_equals_attention_grad_q_and_kv_bit_for_bit(kv_heads, window, softcap, tiles):
    g = torch.Generator().manual_seed(7)
    t = tiles - 1  # the last query tile, which reads every key tile
    q = torch.randn(B, HEADS * D, generator=g)
    do = torch.randn(B, HEADS * D, generator=g)
    kk = [torch.randn(B, kv_heads * D, generator=g) for _ in range(tiles)]
    vv = [torch.randn(B, kv_heads * D, generator=g) for _ in range(tiles)]
    attrs = dict(heads=HEADS, kv_heads=kv_heads, scale=0.3, window=window, softcap=softcap)
    o = _run("attention", [q, *kk, *vv], offset=t * B, **attrs)
    st = _run("attention_stats", [q, *kk, *vv, o, do], offset=t * B, **attrs)
    fused = _run("attention_grad", [q, st, do, *kk, *vv], offset=t * B, **attrs)
    want = [_run("attention_grad_q", [q, st, do, *kk, *vv], offset=t * B, **attrs)]
    for n in range(tiles):
        pair = _run("attention_grad_kv", [q, st, do, kk[n], vv[n]], q_offset=t * B, k_offset=n * B, **attrs)
        want.append(pair)
    assert torch.equal(fused, torch.cat(want, dim=1))


def test_attention_grad_infers_flops_temps_and_refuses_uneven_key_tiles():
    spec = ops.OPS["attention_grad"]
    attrs = spec.full_attrs(dict(heads=HEADS, kv_heads=2, scale=1.0, offset=B))
    shapes = [(B, HEADS * D), (B, 2 * HEADS), (B, HEADS * D), *[(B, 2 * D)] * 4]
    assert spec.infer(shapes, ["float32"] * 7, attrs) == ((B, HEADS * D + 2 * 2 * 2 * D), "float32")
    # causal: the first key tile's pairs all, the second's lower triangle
    assert spec.flops(shapes, None, attrs) == (B * B + B * (B + 1) // 2) * HEADS * (10.0 * D + 4.0)
    ins = [torch.empty(s) for s in shapes]
    assert temp_bytes("attention_grad", torch.empty(B, HEADS * D + 8 * D), ins, attrs) > 0
    with pytest.raises(ValueError, match="attention_grad: every key/value tile must have q's 4 rows"):
        spec.infer([*shapes[:3], (B + 1, 2 * D), (B + 1, 2 * D)], ["float32"] * 5, attrs)
