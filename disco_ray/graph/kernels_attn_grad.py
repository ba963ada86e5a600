"""The torch implementation of `attention_grad` (`ops_attn_grad`): a query tile's dq and each key
tile's dk|dv from one P and dS per key tile, op for op as `attention_grad_q` and
`attention_grad_kv` compute them (so the results are bit-identical to theirs)."""

from __future__ import annotations

import torch

from .kernels_train import (
    Impl,
    _attention_dims,
    _grouped,
    _heads,
    _mask,
    _probs_and_dscores,
    _stats,
    _ungrouped,
)


def _attention_grad(out, ins, attrs):
    q, stats, do, kv = ins[0], ins[1], ins[2], ins[3:]
    h, kvh = _attention_dims(attrs)
    t, m, scale, cap = q.shape[0], len(kv) // 2, attrs["scale"], attrs.get("softcap")
    qg, dog = _grouped(q, kvh, h), _grouped(do, kvh, h)
    lse, dsum = _stats(stats, kvh, h)
    dq = torch.zeros_like(qg)
    col, pos = q.shape[1], 0
    for k, v in zip(kv[:m], kv[m:]):
        mask = _mask(t, k.shape[0], h // kvh, attrs["offset"], pos, attrs, q.device)
        kh, vh = _heads(k, kvh), _heads(v, kvh)
        p, ds = _probs_and_dscores(qg, dog, lse, dsum, kh, vh, scale, mask, cap)
        dq.baddbmm_(ds, kh)
        width = k.shape[1]
        dk = torch.matmul(ds.transpose(1, 2), qg).mul_(scale)
        out[:, col : col + width].unflatten(1, (kvh, -1)).copy_(dk.transpose(0, 1))
        dv = torch.matmul(p.transpose(1, 2), dog)
        out[:, col + width : col + 2 * width].unflatten(1, (kvh, -1)).copy_(dv.transpose(0, 1))
        col, pos = col + 2 * width, pos + k.shape[0]
    out[:, : q.shape[1]].copy_(_ungrouped(dq.mul_(scale), t).flatten(1))


def _attention_grad_temps(out, ins, attrs) -> int:
    # q and do grouped in float32, dq; per key tile its heads, scores, P, dS, dO V^T, mask, dk, dv
    q, kv = ins[0], ins[3:]
    h = attrs["heads"]
    t, tj = q.shape[0], kv[0].shape[0]
    return 4 * (3 * q.numel() + 4 * kv[0].numel() + 4 * h * t * tj) + 2 * h * t * tj + t * tj


KERNELS: dict[str, Impl] = {"attention_grad": _attention_grad}
TEMPS = {"attention_grad": _attention_grad_temps}
