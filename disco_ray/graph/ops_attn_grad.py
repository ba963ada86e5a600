"""The fused attention backward of one query tile (`attention_grad`): its dq and every key tile's
dk|dv partial in one op.

FlashAttention-2's backward (Dao 2023, Algorithm 2) computes a key tile's probabilities P and
dS = P * (dO V^T - D) once and takes dq, dk and dv from them. `attention_grad_q` and
`attention_grad_kv` (`ops_train`) each recompute them, which costs a query tile two more score
products, exponentials and dO V^T per key tile; this op, given the same operands as
`attention_grad_q`, computes them once per key tile (temporaries of one tile pair at a time).
"""

from __future__ import annotations

from .ops_llm import ATTENTION
from .ops_train import _keys, _pairs, check_grad_operands
from .opspec import OpSpec, _same_dtype, register

NAME = "attention_grad"


def _infer(shapes, dtypes, attrs):
    q, kv, kvh, d = check_grad_operands(NAME, shapes, attrs)
    if any(k[0] != q[0] for k in kv):
        raise ValueError(f"{NAME}: every key/value tile must have q's {q[0]} rows, got {[k[0] for k in kv]}")
    m = len(kv) // 2
    return (q[0], q[1] + m * 2 * kvh * d), _same_dtype(NAME, dtypes)


def _flops(shapes, out, attrs):
    q = shapes[0]
    h, d = attrs["heads"], q[1] // attrs["heads"]
    pairs = _pairs(q[0], _keys(shapes[3:]), attrs["offset"], attrs) * h
    return pairs * (10.0 * d + 4.0)  # q k^T, do v^T, ds k, ds^T q, p^T do; p and ds


register(
    OpSpec(
        NAME,
        5,
        None,
        _infer,
        attrs=ATTENTION,
        flops=_flops,
        doc="an attention query tile's backward: operands q [t, heads*d], stats (attention_stats), do, "
        "k_1..k_m, v_1..v_m [t, kv_heads*d]; result [t, heads*d + m*2*kv_heads*d] = [dq | dk_1 dv_1 | "
        "... | dk_m dv_m], each key tile's part summed over the query heads of its key/value head, "
        "P and dS computed once per key tile (attrs as attention)",
    )
)
