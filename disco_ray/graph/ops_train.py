"""The training ops: the backward of the LLaMA layers (RMSNorm, SiLU, attention in tiles, LoRA
weight gradients, embedding), cross-entropy over vocabulary shards and slicing (the optimizer
steps and gradient clipping: `ops_optim`). The backward of rope is rope with `inverse`; of linear
w.r.t. x, matmul.

Attention's backward follows FlashAttention-2 (Dao 2023, Algorithm 2): the forward's per-row
log-sum-exp and D = rowsum(dO * O) are kept as `attention_stats`, so each backward tile recomputes
its probabilities P = exp(S - lse) from q and one key tile; no [seq, seq] matrix is ever stored.
"""

from __future__ import annotations

import math

from .ops_llm import ATTENTION, _check_kv, _heads, _int_attr, _window, window_pairs
from .opspec import REQUIRED, OpSpec, Shape, _same_dtype, elementwise, no_flops, numel, register

INTS = ("int32", "int64")


def _number(name: str, attrs, key: str, lo: float | None = None, below: float | None = None) -> float:
    """Attribute `key` as a number in [lo, below), or ValueError naming the op and the attribute."""
    x = attrs[key]
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"{name}: attribute {key} must be a finite number, got {x!r}")
    if (lo is not None and not x >= lo) or (below is not None and not x < below):
        lo_s = "" if lo is None else f"{lo} <= "
        hi_s = "" if below is None else f" < {below}"
        raise ValueError(f"{name}: attribute {key} must satisfy {lo_s}{key}{hi_s}, got {x!r}")
    return x


def _bool(name: str, attrs, key: str) -> bool:
    if not isinstance(attrs[key], bool):
        raise ValueError(f"{name}: attribute {key} must be true or false, got {attrs[key]!r}")
    return attrs[key]


def _labels(name: str, shape, dtype: str, t: int, what: str = "labels") -> None:
    if shape != (t,) or dtype not in INTS:
        raise ValueError(f"{name}: {what} must be an integer vector [{t}], got {list(shape)} {dtype}")


# ---- elementwise backward ----------------------------------------------------------------------
def _infer_rmsnorm_grad(shapes, dtypes, attrs):
    x, w, dy = shapes
    _number("rmsnorm_grad", attrs, "eps", lo=0.0)
    if not x or w != (x[-1],) or dy != x:
        raise ValueError(
            f"rmsnorm_grad needs x [.., d], w [d] and dy shaped as x, got {[list(s) for s in shapes]}"
        )
    return x, _same_dtype("rmsnorm_grad", dtypes)


def _infer_silu_grad(shapes, dtypes, attrs):
    if shapes[0] != shapes[1]:
        raise ValueError(f"silu_grad operands have different shapes {[list(s) for s in shapes]}")
    return shapes[0], _same_dtype("silu_grad", dtypes)


# ---- attention backward ------------------------------------------------------------------------
def _attn_attrs(name: str, q, attrs) -> tuple[int, int, int]:
    h, kvh, d = _heads(name, q, attrs)
    _bool(name, attrs, "causal")
    _window(name, attrs)
    return h, kvh, d


def _infer_attention_stats(shapes, dtypes, attrs):
    name = "attention_stats"
    if len(shapes) % 2 == 0:
        raise ValueError(f"{name} takes q, pairs of key/value tiles, o and do, got {len(shapes)} operands")
    q, kv, o, do = shapes[0], shapes[1:-2], shapes[-2], shapes[-1]
    h, kvh, d = _attn_attrs(name, q, attrs)
    _int_attr(name, attrs, "offset", -(1 << 62))
    _check_kv(name, kv, kvh * d, f"q {list(q)} with kv_heads={kvh}")
    if o != q or do != q:
        raise ValueError(f"{name}: o {list(o)} and do {list(do)} must be shaped as q {list(q)}")
    return (q[0], 2 * h), _same_dtype(name, dtypes)


def _pairs(t: int, keys: int, offset: int, attrs) -> int:
    return window_pairs(t, keys, offset, attrs["causal"], attrs.get("window", 0))


def _keys(kv) -> int:
    return sum(s[0] for s in kv[: len(kv) // 2])


def _flops_attention_stats(shapes, out, attrs):
    q = shapes[0]
    h, d = attrs["heads"], q[1] // attrs["heads"]
    pairs = _pairs(q[0], _keys(shapes[1:-2]), attrs["offset"], attrs) * h
    return pairs * (2.0 * d + 3.0) + 2.0 * numel(q)  # q k^T, exp and sum; rowsum(do * o)


def _check_q_stats_do(name: str, q, stats, do, h: int) -> None:
    if stats != (q[0], 2 * h) or do != q:
        raise ValueError(
            f"{name}: stats must be [{q[0]}, {2 * h}] and do shaped as q {list(q)}, "
            f"got {list(stats)} and {list(do)}"
        )


def check_grad_operands(name: str, shapes, attrs):
    """q, the key/value tiles, kv heads and head dim of an attention gradient taking q, stats, do
    and pairs of key/value tiles (`attention_grad_q`, `attention_grad`); ValueError if they do not fit."""
    if len(shapes) < 5 or len(shapes) % 2 == 0:
        raise ValueError(
            f"{name} takes q, stats, do and pairs of key/value tiles, got {len(shapes)} operands"
        )
    q, stats, do, kv = shapes[0], shapes[1], shapes[2], shapes[3:]
    h, kvh, d = _attn_attrs(name, q, attrs)
    _int_attr(name, attrs, "offset", -(1 << 62))
    _check_q_stats_do(name, q, stats, do, h)
    _check_kv(name, kv, kvh * d, f"q {list(q)} with kv_heads={kvh}")
    return q, kv, kvh, d


def _infer_attention_grad_q(shapes, dtypes, attrs):
    q = check_grad_operands("attention_grad_q", shapes, attrs)[0]
    return q, _same_dtype("attention_grad_q", dtypes)


def _flops_attention_grad_q(shapes, out, attrs):
    q = shapes[0]
    h, d = attrs["heads"], q[1] // attrs["heads"]
    pairs = _pairs(q[0], _keys(shapes[3:]), attrs["offset"], attrs) * h
    return pairs * (6.0 * d + 4.0)  # q k^T, do v^T, ds k (2 flops per multiply-add each), p and ds


def _infer_attention_grad_kv(shapes, dtypes, attrs):
    name = "attention_grad_kv"
    q, stats, do, k, v = shapes
    h, kvh, d = _attn_attrs(name, q, attrs)
    _int_attr(name, attrs, "q_offset", -(1 << 62))
    _int_attr(name, attrs, "k_offset", -(1 << 62))
    _check_q_stats_do(name, q, stats, do, h)
    _check_kv(name, [k, v], kvh * d, f"q {list(q)} with kv_heads={kvh}")
    return (k[0], 2 * kvh * d), _same_dtype(name, dtypes)


def _flops_attention_grad_kv(shapes, out, attrs):
    q, k = shapes[0], shapes[3]
    h, d = attrs["heads"], q[1] // attrs["heads"]
    offset = attrs["q_offset"] - attrs["k_offset"]
    pairs = _pairs(q[0], k[0], offset, attrs) * h
    return pairs * (8.0 * d + 4.0)  # q k^T, do v^T, p^T do, ds^T q; p and ds


# ---- linear, cross-entropy, embedding ----------------------------------------------------------
def _infer_linear_grad_w(shapes, dtypes, attrs):
    dy, x = shapes
    _number("linear_grad_w", attrs, "scale")
    if len(dy) < 2 or len(x) < 2 or dy[:-1] != x[:-1]:
        raise ValueError(
            f"linear_grad_w needs dy [.., n, out] and x [.., n, in] with the same rows, "
            f"got {list(dy)} and {list(x)}"
        )
    return (dy[-1], x[-1]), _same_dtype("linear_grad_w", dtypes)


def _vocab_shard(name: str, shapes, dtypes, attrs) -> Shape:
    logits, labels = shapes[0], shapes[1]
    _int_attr(name, attrs, "start")
    if len(logits) != 2:
        raise ValueError(f"{name}: logits must be [t, v], got {list(logits)}")
    _labels(name, labels, dtypes[1], logits[0])
    _same_dtype(name, dtypes[:1])
    return logits


def _infer_cross_entropy_parts(shapes, dtypes, attrs):
    t, _ = _vocab_shard("cross_entropy_parts", shapes, dtypes, attrs)
    return (t, 2), dtypes[0]


def _infer_cross_entropy_combine(shapes, dtypes, attrs):
    name = "cross_entropy_combine"
    parts, labels = shapes[:-1], shapes[-1]
    t = parts[0][0] if parts[0] else 0
    if any(p != (t, 2) for p in parts):
        raise ValueError(f"{name}: parts must all be [t, 2], got {[list(p) for p in parts]}")
    _labels(name, labels, dtypes[-1], t)
    return (t, 2), _same_dtype(name, dtypes[:-1])


def _infer_cross_entropy_grad(shapes, dtypes, attrs):
    name = "cross_entropy_grad"
    _number(name, attrs, "scale")
    logits = _vocab_shard(name, shapes, dtypes, attrs)
    if shapes[2] != (logits[0], 2):
        raise ValueError(f"{name}: combined must be [{logits[0]}, 2], got {list(shapes[2])}")
    return logits, _same_dtype(name, [dtypes[0], dtypes[2]])


def _infer_embedding_grad(shapes, dtypes, attrs):
    name = "embedding_grad"
    ids, dy = shapes
    _int_attr(name, attrs, "start")
    rows = _int_attr(name, attrs, "rows", 1)
    if len(dy) != 2:
        raise ValueError(f"{name}: dy must be [t, d], got {list(dy)}")
    _labels(name, ids, dtypes[0], dy[0], "ids")
    return (rows, dy[1]), _same_dtype(name, dtypes[1:])


# ---- slicing ------------------------------------------------------------------------------------
def _infer_slice(shapes, dtypes, attrs):
    (x,) = shapes
    axis = _int_attr("slice", attrs, "axis", -(1 << 62))
    if not -len(x) <= axis < len(x):
        raise ValueError(f"slice: axis {axis} out of range for rank {len(x)}")
    start, stop = _int_attr("slice", attrs, "start"), _int_attr("slice", attrs, "stop")
    if not start < stop <= x[axis]:
        raise ValueError(f"slice: [{start}, {stop}) is not a non-empty range of 0..{x[axis]} on axis {axis}")
    out = list(x)
    out[axis] = stop - start
    return tuple(out), dtypes[0]


register(
    OpSpec(
        "rmsnorm_grad",
        3,
        3,
        _infer_rmsnorm_grad,
        attrs={"eps": 1e-6, "offset": 0.0},
        flops=elementwise(8),
        doc="dx of y = rmsnorm(x) * (w + offset) for x [.., d], w [d] (frozen), dy [.., d]: r * (dy*w' - "
        "x * r^2 * mean(dy*w'*x)), w' = w + offset, r = 1/sqrt(mean(x^2) + eps), in float32",
    )
)
register(
    OpSpec(
        "silu_grad",
        2,
        2,
        _infer_silu_grad,
        flops=elementwise(6),
        doc="dh * silu'(a) for a, dh of one shape: silu'(a) = s * (1 + a * (1 - s)), s = sigmoid(a)",
    )
)
register(
    OpSpec(
        "attention_stats",
        5,
        None,
        _infer_attention_stats,
        attrs=ATTENTION,
        flops=_flops_attention_stats,
        doc="what attention's backward keeps of a query tile: operands q [t, heads*d], k_1..k_m, "
        "v_1..v_m, o (attention's output), do (its gradient); result [t, 2*heads]: per head the "
        "log-sum-exp of the masked scaled scores over all keys, then D = rowsum(do * o) (attrs as attention; "
        "float32 inside, stored in q's dtype)",
    )
)
register(
    OpSpec(
        "attention_grad_q",
        5,
        None,
        _infer_attention_grad_q,
        attrs=ATTENTION,
        flops=_flops_attention_grad_q,
        doc="dq [t, heads*d] of an attention query tile: operands q, stats (attention_stats), do, "
        "k_1..k_m, v_1..v_m; per head scale * dS k with P = exp(S - lse), dS = P * (do v^T - D), "
        "the scores recomputed one key tile at a time (attrs as attention)",
    )
)
register(
    OpSpec(
        "attention_grad_kv",
        5,
        5,
        _infer_attention_grad_kv,
        attrs={k: v for k, v in ATTENTION.items() if k != "offset"} | {"q_offset": 0, "k_offset": 0},
        flops=_flops_attention_grad_kv,
        doc="one query tile's part of dk and dv of one key tile: operands q, stats, do, k_j, v_j "
        "[t_j, kv_heads*d]; result [t_j, 2*kv_heads*d] = [scale * dS^T q | P^T do], summed over the "
        "query heads of each key/value head; q's row 0 at position q_offset, k_j's at k_offset, keys "
        "at positions <= the query's when causal, and > the query's - window when window > 0 (the "
        "caller sums the query tiles' parts)",
    )
)
register(
    OpSpec(
        "linear_grad_w",
        2,
        2,
        _infer_linear_grad_w,
        attrs={"scale": 1.0},
        flops=lambda s, o, a: 2.0 * numel(s[0]) * s[1][-1],
        doc="scale * dy^T @ x for dy [.., n, out], x [.., n, in] -> [out, in]: the gradient of "
        "linear's weight (rows are tokens, summed)",
    )
)
register(
    OpSpec(
        "cross_entropy_parts",
        2,
        2,
        _infer_cross_entropy_parts,
        attrs={"start": 0},
        flops=elementwise(3),  # per logit: exp, sum; one gather per row
        doc="a vocabulary shard's part of cross-entropy: logits [t, v] (ids start..start+v-1), labels "
        "[t] (int; -100 ignored) -> [t, 2]: the shard's log-sum-exp per row, the label's logit if the "
        "shard holds it else 0 (float32 inside, logits' dtype)",
    )
)
register(
    OpSpec(
        "cross_entropy_combine",
        2,
        None,
        _infer_cross_entropy_combine,
        flops=lambda s, o, a: 4.0 * (len(s) - 1) * o[0],
        doc="parts_1..parts_G (cross_entropy_parts of every shard), labels [t] -> [t, 2]: each row's loss "
        "logsumexp(lse_g) - sum(label logits) (0 where label = -100), then the overall log-sum-exp",
    )
)
register(
    OpSpec(
        "cross_entropy_grad",
        3,
        3,
        _infer_cross_entropy_grad,
        attrs={"start": 0, "scale": 1.0},
        flops=elementwise(4),
        doc="dlogits of a vocabulary shard: logits [t, v], labels [t], combined [t, 2] "
        "(cross_entropy_combine) -> scale * (exp(logits - lse) - onehot(label - start)), rows with "
        "label -100 zero (the shards' results side by side: the gradient of scale * sum of losses)",
    )
)
register(
    OpSpec(
        "embedding_grad",
        2,
        2,
        _infer_embedding_grad,
        attrs={"start": 0, "rows": REQUIRED},
        flops=lambda s, o, a: float(numel(s[1])),
        doc="the gradient of an embedding table shard: ids [t] (int), dy [t, d] -> [rows, d], dy's row "
        "i added into row ids[i] - start (ids outside start..start+rows-1 ignored)",
    )
)
register(
    OpSpec(
        "slice",
        1,
        1,
        _infer_slice,
        attrs={"axis": REQUIRED, "start": REQUIRED, "stop": REQUIRED},
        flops=no_flops,
        doc="a copy of x's indices start..stop-1 along axis",
    )
)
