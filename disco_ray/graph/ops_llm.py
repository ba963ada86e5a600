"""The transformer ops: concat, rotary embedding, attention (prefill tiles and cached decode),
KV cache writes, linear layers in the checkpoint's [out, in] layout, and embedding lookups.
Kernels live in `kernels_llm`."""

from __future__ import annotations

import math

from .opspec import ATTR_TYPES, REQUIRED, OpSpec, _is_int, _same_dtype, no_flops, numel, register
from .quant import Quant

for _op in ("attention_at", "attention_span"):  # an int8 KV cache's packing (null: floats)
    for _a in ("kv_bits", "kv_group"):
        ATTR_TYPES[(_op, _a)] = (lambda x: x is None or (_is_int(x) and x >= 1), "null or an integer >= 1")


def _infer_concat(shapes, dtypes, attrs):
    rank = len(shapes[0])
    axis = attrs["axis"]
    if not -rank <= axis < rank:
        raise ValueError(f"concat axis {axis} out of range for rank {rank}")
    axis %= rank
    for s in shapes[1:]:
        if len(s) != rank or any(a != b for d, (a, b) in enumerate(zip(s, shapes[0])) if d != axis):
            raise ValueError(f"concat operands {[list(x) for x in shapes]} differ off axis {axis}")
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    return tuple(out), _same_dtype("concat", dtypes, floats=False)


def _infer_rope(shapes, dtypes, attrs):
    x, cos, sin = shapes
    if len(x) < 2 or len(cos) != 2 or cos != sin:
        raise ValueError(f"rope needs x [.., s, h*d] and cos, sin [s, d], got {[list(s) for s in shapes]}")
    s, d = cos
    if d % 2 or x[-2] != s or x[-1] % d:
        raise ValueError(f"rope: x {list(x)} does not fit cos/sin {[s, d]} (even d dividing the last dim)")
    if not isinstance(attrs.get("inverse", False), bool):
        raise ValueError(f"rope: attribute inverse must be true or false, got {attrs['inverse']!r}")
    return x, _same_dtype("rope", dtypes)


def _flops_rope(shapes, out, attrs):
    return 3.0 * numel(out)


def _int_attr(name: str, attrs, key: str, lo: int = 0) -> int:
    x = attrs[key]
    if not isinstance(x, int) or isinstance(x, bool) or x < lo:
        raise ValueError(f"{name}: attribute {key} must be an integer >= {lo}, got {x!r}")
    return x


def _heads(name: str, q, attrs) -> tuple[int, int, int]:
    """(heads, kv_heads, head dim) of an attention op's q [t, heads*d] and attrs; grouped-query
    attention when kv_heads < heads (each key/value head serves heads/kv_heads query heads)."""
    h = _int_attr(name, attrs, "heads", 1)
    kvh = h if attrs.get("kv_heads") is None else _int_attr(name, attrs, "kv_heads", 1)
    if len(q) != 2 or q[1] % h:
        raise ValueError(f"{name}: q must be [t, heads*d] with heads={h} dividing it, got {list(q)}")
    if h % kvh:
        raise ValueError(f"{name}: kv_heads {kvh} must divide heads {h}")
    if isinstance(attrs.get("scale"), bool) or not isinstance(attrs.get("scale"), (int, float)):
        raise ValueError(f"{name}: attribute scale must be a number, got {attrs.get('scale')!r}")
    cap = attrs.get("softcap")
    if cap is not None and (
        isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf
    ):
        raise ValueError(f"{name}: attribute softcap must be null or a positive finite number, got {cap!r}")
    return h, kvh, q[1] // h


def _window(name: str, attrs) -> int:
    """The sliding window of an attention op: a query at position p sees keys in (p - window, p]
    (transformers' sliding_window); 0: every earlier key."""
    return _int_attr(name, attrs, "window") if "window" in attrs else 0


def _check_kv(name: str, kv, width: int, what: str) -> None:
    m = len(kv) // 2
    for j in range(m):
        k, v = kv[j], kv[m + j]
        if len(k) != 2 or k[1] != width or v != k:
            raise ValueError(f"{name}: key/value tile {j} {list(k)}/{list(v)} does not match {what}")


# attention's attributes (and its backward's); softcap: the scores soft-capped to
# cap * tanh(s / cap) before the mask (Gemma 2; None: not capped)
ATTENTION = {
    "heads": REQUIRED,
    "scale": REQUIRED,
    "offset": 0,
    "causal": True,
    "kv_heads": None,
    "window": 0,
    "softcap": None,
}


def _infer_attention(shapes, dtypes, attrs):
    if len(shapes) % 2 == 0:
        raise ValueError(f"attention takes q and pairs of key/value tiles, got {len(shapes)} operands")
    q, kv = shapes[0], shapes[1:]
    _, kvh, d = _heads("attention", q, attrs)
    _int_attr("attention", attrs, "offset", -(1 << 62))
    _window("attention", attrs)
    _check_kv("attention", kv, kvh * d, f"q {list(q)} with kv_heads={kvh}")
    return q, _same_dtype("attention", dtypes)


def attention_pairs(t: int, keys: int, offset: int, causal: bool) -> int:
    """Number of (query row, key) pairs an attention tile scores: query row r sees keys <= offset + r."""
    if not causal:
        return t * keys
    a = offset + 1  # row r sees min(keys, max(0, a + r)) keys
    lo = min(t, max(0, 1 - a))  # rows before lo see none (a key tile after the queries)
    hi = min(t, max(lo, keys - a))  # rows lo..hi-1 see a + r, the rest all keys
    return (hi - lo) * a + (lo + hi - 1) * (hi - lo) // 2 + (t - hi) * keys


def window_pairs(t: int, keys: int, offset: int, causal: bool, window: int) -> int:
    """`attention_pairs` within a sliding window (0: none): the keys <= offset + r less those
    <= offset + r - window."""
    pairs = attention_pairs(t, keys, offset, causal)
    return pairs - attention_pairs(t, keys, offset - window, True) if causal and window else pairs


def _flops_attention(shapes, out, attrs):
    q = shapes[0]
    keys = sum(s[0] for s in shapes[1 : 1 + len(shapes) // 2])
    d = q[1] // attrs["heads"]
    pairs = window_pairs(q[0], keys, attrs["offset"], attrs["causal"], attrs.get("window", 0))
    pairs *= attrs["heads"]
    return pairs * (4.0 * d + 5.0)  # q k^T and p v (2 flops per multiply-add each), softmax


def _infer_attention_at(shapes, dtypes, attrs):
    if len(shapes) < 4 or len(shapes) % 2:
        raise ValueError(
            f"attention_at takes q, pos and pairs of key/value tiles, got {len(shapes)} operands"
        )
    q, pos, kv = shapes[0], shapes[1], shapes[2:]
    _, kvh, d = _heads("attention_at", q, attrs)
    if pos != (1,) or dtypes[1] not in ("int32", "int64"):
        raise ValueError(
            f"attention_at: pos must be an integer tensor of shape [1], got {list(pos)} {dtypes[1]}"
        )
    if "start" in attrs:
        _int_attr("attention_at", attrs, "start")
    _window("attention_at", attrs)
    width, kvd = _packed_kv("attention_at", attrs, kvh * d, dtypes[2:])
    _check_kv("attention_at", kv, width, f"q {list(q)} with kv_heads={kvh}{kvd}")
    return q, _same_dtype("attention_at", [dtypes[0]] if kvd else [dtypes[0], *dtypes[2:]])


def _flops_attention_at(shapes, out, attrs):  # an upper bound: every key scored (pos is data)
    q = shapes[0]
    keys = sum(s[0] for s in shapes[2 : 2 + (len(shapes) - 2) // 2])
    return q[0] * keys * attrs["heads"] * (4.0 * q[1] / attrs["heads"] + 5.0)


def _infer_attention_span(shapes, dtypes, attrs):
    groups = _int_attr("attention_span", attrs, "groups", 1)
    if len(shapes) < 4 or (len(shapes) - 2) % (2 * groups):
        raise ValueError(
            f"attention_span takes q, span and {groups} group(s) of key tiles then of value tiles, "
            f"got {len(shapes)} operands"
        )
    q, span, kv = shapes[0], shapes[1], shapes[2:]
    _, kvh, d = _heads("attention_span", q, attrs)
    if q[0] % groups:
        raise ValueError(f"attention_span: {q[0]} query rows do not split into {groups} groups")
    if span != (q[0], 2) or dtypes[1] not in ("int32", "int64"):
        raise ValueError(
            f"attention_span: span must be integers [{q[0]}, 2] (a key range per query row), "
            f"got {list(span)} {dtypes[1]}"
        )
    if "start" in attrs:
        _int_attr("attention_span", attrs, "start")
    _window("attention_span", attrs)
    width, kvd = _packed_kv("attention_span", attrs, kvh * d, dtypes[2:])
    _check_kv("attention_span", kv, width, f"q {list(q)} with kv_heads={kvh}{kvd}")
    m = len(kv) // 2 // groups  # key tiles per group: the same shapes in every group
    if any(kv[g * m + j] != kv[j] for g in range(groups) for j in range(m)):
        raise ValueError(f"attention_span: the {groups} groups' key tiles differ in shape")
    return q, _same_dtype("attention_span", [dtypes[0]] if kvd else [dtypes[0], *dtypes[2:]])


def _packed_kv(name: str, attrs, width: int, dtypes) -> tuple[int, str]:
    """A cached attention's key/value tiles' width, and how they are packed ("": the compute
    dtype's floats): with kv_bits, uint8 rows of `width` elements in `quant`'s layout, kv_group
    elements per scale and zero point."""
    bits, group = attrs.get("kv_bits"), attrs.get("kv_group")
    if bits is None and group is None:
        return width, ""
    try:
        q = Quant(bits, group)  # type: ignore[arg-type]
    except Exception as e:  # UsageError: a bad bits or group, said as the op's reason
        raise ValueError(f"{name}: packed key/value tiles: {e}") from None
    if any(dt != "uint8" for dt in dtypes):
        raise ValueError(
            f"{name}: kv_bits {bits}: the key/value tiles must be uint8, got {sorted(set(dtypes))}"
        )
    return q.packed_shape((1, width))[1], f" packed as int{bits}, group {group} (uint8)"


def _flops_attention_span(shapes, out, attrs):  # an upper bound: every key of its group scored
    q, groups = shapes[0], attrs["groups"]
    keys = sum(s[0] for s in shapes[2 : 2 + (len(shapes) - 2) // 2]) // groups
    return q[0] * keys * attrs["heads"] * (4.0 * q[1] / attrs["heads"] + 5.0)


def _infer_kv_write(shapes, dtypes, attrs):
    block, new, pos = shapes
    _int_attr("kv_write", attrs, "start")
    row = attrs.get("row")
    if row is not None:
        _int_attr("kv_write", attrs, "row")
        if len(new) != 2 or row >= new[0]:
            raise ValueError(f"kv_write: row {row} is not a row of the new rows {list(new)}")
        new = (1, *new[1:])
    if len(block) != 2 or len(new) != 2 or new[1] != block[1] or new[0] > block[0]:
        raise ValueError(f"kv_write: new rows {list(new)} do not fit the block {list(block)}")
    if pos != (1,) or dtypes[2] not in ("int32", "int64"):
        raise ValueError(f"kv_write: pos must be an integer tensor of shape [1], got {list(pos)} {dtypes[2]}")
    return block, _same_dtype("kv_write", dtypes[:2], floats=False)


def _infer_linear(shapes, dtypes, attrs):
    x, w = shapes[:2]
    if len(x) < 1 or len(w) != 2 or x[-1] != w[1]:
        raise ValueError(f"linear needs x [.., k] and w [n, k], got {list(x)} and {list(w)}")
    if len(shapes) == 3 and shapes[2] != (w[0],):
        raise ValueError(f"linear: the bias must have shape [{w[0]}], got {list(shapes[2])}")
    sc = attrs.get("scale", 1.0)
    if isinstance(sc, bool) or not isinstance(sc, (int, float)) or not math.isfinite(sc):
        raise ValueError(f"linear: attribute scale must be a finite number, got {sc!r}")
    return (*x[:-1], w[0]), _same_dtype("linear", dtypes)


def _infer_embedding(shapes, dtypes, attrs):
    ids, table = shapes
    _int_attr("embedding", attrs, "start")
    if len(ids) < 1 or dtypes[0] not in ("int32", "int64"):
        raise ValueError(f"embedding: ids must be integers [t] or [.., t], got {list(ids)} {dtypes[0]}")
    if len(table) != 2:
        raise ValueError(f"embedding: the table must be [rows, dim], got {list(table)}")
    # a packed (uint8) table: its packed rows, which `dequant` turns into floats
    return (*ids, table[1]), _same_dtype("embedding", dtypes[1:], floats=dtypes[1] != "uint8")


register(
    OpSpec(
        "concat",
        1,
        None,
        _infer_concat,
        attrs={"axis": -1},
        flops=no_flops,
        doc="operands of one shape but along `axis` joined along it",
    )
)
register(
    OpSpec(
        "rope",
        3,
        3,
        _infer_rope,
        attrs={"inverse": False},
        flops=_flops_rope,
        doc="rotary embedding of x [.., s, heads*d] per head (rotate-half form): x*cos + rot(x)*sin, "
        "cos and sin [s, d]; inverse: the transpose x*cos - rot(x*sin), rope's backward (and its inverse "
        "for LLaMA's cos/sin, whose halves are equal)",
    )
)
register(
    OpSpec(
        "attention",
        3,
        None,
        _infer_attention,
        attrs=ATTENTION,
        flops=_flops_attention,
        doc="one query tile of multi-head attention: operands q [t, heads*d], key tiles k_1..k_m, then "
        "value tiles v_1..v_m (each [t_j, kv_heads*d], keys in order); softmax(q k^T * scale + mask) v "
        "per head, where query row r may see key rows <= offset + r when causal; kv_heads < heads "
        "is grouped-query attention (None: kv_heads = heads); window w > 0 (causal): row r sees only key "
        "rows > offset + r - w (sliding-window attention); softcap: the scores soft-capped to "
        "softcap * tanh(s / softcap) before the mask (Gemma 2; None: not capped)",
    )
)
register(
    OpSpec(
        "attention_at",
        4,
        None,
        _infer_attention_at,
        attrs={
            "heads": REQUIRED,
            "scale": REQUIRED,
            "kv_heads": None,
            "start": 0,
            "window": 0,
            "softcap": None,
            "kv_bits": None,
            "kv_group": None,
        },
        flops=_flops_attention_at,
        doc="attention of q [t, heads*d] at run-time position pos (int [1]) over cached key tiles k_1..k_m "
        "then value tiles v_1..v_m ([t_j, kv_heads*d], positions start.. in order): query row r sees keys "
        "at positions <= pos + r, and > pos + r - window when window > 0 (a decode step's attention over "
        "its KV cache, from its first block in the window; no host sync); softcap as attention's; "
        "kv_bits, kv_group: packed tiles as attention_span's",
    )
)
register(
    OpSpec(
        "attention_span",
        4,
        None,
        _infer_attention_span,
        attrs={
            "heads": REQUIRED,
            "scale": REQUIRED,
            "kv_heads": None,
            "groups": 1,
            "start": 0,
            "window": 0,
            "softcap": None,
            "kv_bits": None,
            "kv_group": None,
        },
        flops=_flops_attention_span,
        doc="attention of q [groups*t, heads*d] where each group of t query rows has key tiles of its own: "
        "operands q, span (int [groups*t, 2]), the key tiles k_{1,1}..k_{1,m}, .., k_{groups,m}, then the "
        "value tiles in the same order ([t_j, kv_heads*d], the same shapes in every group, the first at "
        "index start); query row r sees its group's keys at indices span[r,0]..span[r,1] (and > "
        "span[r,1] - window when window > 0) and always the one at span[r,1] (a "
        "padding row sees itself: finite, never NaN). Ragged batches: left padding and causality as "
        "run-time data; softcap as attention's; kv_bits 8 (kv_group g): the key/value tiles are "
        "packed uint8 rows (`quant`'s layout, g elements per scale and zero point), dequantized in "
        "the kernel (an int8 KV cache; null: floats in q's dtype)",
    )
)
register(
    OpSpec(
        "kv_write",
        3,
        3,
        _infer_kv_write,
        attrs={"start": 0, "row": None},
        flops=no_flops,
        doc="a KV cache block [b, c] (positions start..start+b-1) with new rows [t, c] written at positions "
        "pos..pos+t-1 (pos: int [1], read on the device); row r: only new row r, at pos",
    )
)
register(
    OpSpec(
        "linear",
        2,
        3,
        _infer_linear,
        attrs={"scale": 1.0},
        flops=lambda s, o, a: 2.0 * numel(o) * s[0][-1],
        doc="scale * x [.., k] @ w[n, k]^T [+ b [n]] -> [.., n]: a linear layer with the weight as "
        "checkpoints and torch.nn.Linear store it (scale: a LoRA adapter's alpha / rank)",
    )
)
register(
    OpSpec(
        "embedding",
        2,
        2,
        _infer_embedding,
        attrs={"start": 0, "scale": 1.0},
        flops=no_flops,
        doc="rows of table [r, d] for ids [t] or [.., t] (int): row id - start, zeros for ids outside "
        "start..start+r-1 (a vocabulary shard: the shards' lookups sum to the whole table's), times "
        "scale (Gemma's sqrt(hidden_size), rounded to the table's dtype)",
    )
)
