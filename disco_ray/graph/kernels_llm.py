"""Torch implementations of the transformer ops (`ops_llm`), each writing into a given output view.

`KERNELS` maps op names to functions `(out, ins, attrs)` and `TEMPS` to what they allocate
besides `out` (bytes, an upper bound on CUDA); `kernels` merges both (this module imports nothing
of the project, so no cycle). The same code runs on CPU tensors and on CUDA views of a GPU arena.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]
KERNELS: dict[str, Impl] = {}
TEMPS: dict[str, TempBytes] = {}
# op -> the byte range [lo, hi) of `out` that may differ from its first input: when such a kernel
# writes a carried value on top of its loaded state, the worker saves only those bytes
CHANGED: dict[str, Callable[[torch.Tensor, list[torch.Tensor], Mapping], tuple[int, int]]] = {}


def _into(table: dict, name: str):
    """Decorator: the function is op `name`'s entry of `table` (KERNELS or TEMPS)."""

    def deco(fn):
        table[name] = fn
        return fn

    return deco


@_into(KERNELS, "concat")
def _concat(out, ins, attrs):
    torch.cat(ins, dim=attrs["axis"], out=out)


@_into(KERNELS, "rope")
def _rope(out, ins, attrs):
    x, cos, sin = ins
    d = cos.shape[-1]
    xv = x.unflatten(-1, (-1, d))  # [.., s, heads, d]
    ov = out.unflatten(-1, (-1, d))
    if attrs.get("inverse", False):  # .get: vertices saved before the attribute existed
        # the transpose of x -> x*cos + rot(x)*sin, since rot^T = -rot: x*cos - rot(x*sin)
        xs = xv * sin.unsqueeze(-2)
        torch.mul(xv, cos.unsqueeze(-2), out=ov)
        ov[..., : d // 2].add_(xs[..., d // 2 :])
        ov[..., d // 2 :].sub_(xs[..., : d // 2])
        return
    rot = torch.cat((-xv[..., d // 2 :], xv[..., : d // 2]), dim=-1)
    torch.mul(xv, cos.unsqueeze(-2), out=ov)
    ov.addcmul_(rot, sin.unsqueeze(-2))


def _sdpa(out, q, ks, vs, h: int, kvh: int, scale: float, mask, softcap: float | None = None) -> None:
    """softmax(q k^T * scale + mask) v per head, written into out [t, h*d]; k/v tiles [t_j, kvh*d]
    (grouped-query attention when kvh < h: each key/value head serves h/kvh query heads); with
    `softcap` the scores are capped to softcap * tanh(s / softcap) before the mask."""
    from torch.nn.functional import scaled_dot_product_attention

    def heads(x, n):  # [rows, n*d] -> [1, n, rows, d], the layout the fused kernels take
        return x.unflatten(-1, (n, -1)).transpose(0, 1).unsqueeze(0)

    k = heads(ks[0] if len(ks) == 1 else torch.cat(ks, dim=0), kvh)
    v = heads(vs[0] if len(vs) == 1 else torch.cat(vs, dim=0), kvh)
    t, g = q.shape[0], h // kvh
    if (g > 1 and t * g <= 64) or softcap is not None:
        # a few query rows (a decode step): each key/value head's group of query heads in one
        # product, instead of copying keys and values per query head for the fused kernel; and
        # capped scores, which no fused kernel computes
        qg = q.unflatten(-1, (kvh, g, -1)).permute(1, 2, 0, 3).reshape(kvh, g * t, -1)
        sc = torch.matmul(qg, k[0].transpose(-1, -2)).mul_(scale)
        if softcap is not None:
            sc.div_(softcap).tanh_().mul_(softcap)
        if mask is not None:
            sc.masked_fill_(~mask.repeat(g, 1), float("-inf"))
        o = torch.matmul(sc.softmax(-1), v[0])  # [kvh, g*t, d]
        out.unflatten(-1, (kvh, g, -1)).copy_(o.unflatten(1, (g, t)).permute(2, 0, 1, 3))
        return
    if kvh != h:
        k, v = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
    o = scaled_dot_product_attention(heads(q, h), k, v, attn_mask=mask, scale=scale)
    out.unflatten(-1, (h, -1)).copy_(o[0].transpose(0, 1))


def seen(keys: torch.Tensor, rows: torch.Tensor, window: int) -> torch.Tensor:
    """Which key positions `keys` a query at position `rows` sees (broadcast): those <= it, and
    within its sliding window (> it - window) when window > 0."""
    mask = keys <= rows
    return mask & (keys > rows - window) if window else mask


@_into(KERNELS, "attention")
def _attention(out, ins, attrs):
    q, kv = ins[0], ins[1:]
    m = len(kv) // 2
    h = attrs["heads"]
    kvh = attrs["kv_heads"] or h
    t, s = q.shape[0], sum(k.shape[0] for k in kv[:m])
    mask = None
    window = attrs.get("window", 0)  # .get: vertices saved before the attribute existed
    if (
        attrs["causal"]
        and attrs["offset"] == s - t
        and q.is_cuda
        and not window
        and attrs.get("softcap") is None
    ):
        # a query tile ending at the last key: the fused causal kernels (importing the bias
        # module costs ~2 s once, which the cpu backend, with no fused kernel to gain, skips)
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(t, s)
    elif attrs["causal"]:
        rows = torch.arange(t, device=q.device).unsqueeze(1) + attrs["offset"]
        mask = seen(torch.arange(s, device=q.device).unsqueeze(0), rows, window)
    _sdpa(out, q, kv[:m], kv[m:], h, kvh, attrs["scale"], mask, attrs.get("softcap"))


@_into(KERNELS, "attention_at")
def _attention_at(out, ins, attrs):
    # the mask is made on the device from pos: a decode step never waits for the host
    q, pos, kv = ins[0], ins[1], ins[2:]
    m = len(kv) // 2
    h = attrs["heads"]
    t, s = q.shape[0], sum(k.shape[0] for k in kv[:m])
    rows = torch.arange(t, device=q.device).unsqueeze(1) + pos
    keys = torch.arange(s, device=q.device).unsqueeze(0) + attrs.get("start", 0)
    mask = seen(keys, rows, attrs.get("window", 0))
    kvh = attrs["kv_heads"] or h
    if attrs.get("kv_bits") is not None:  # packed tiles (an int8 KV cache): keys and values as floats
        width = q.shape[1] // h * kvh
        kv, m = [_dequant_stacked(x, 1, m, width, q.dtype, attrs)[0] for x in (kv[:m], kv[m:])], 1
    _sdpa(out, q, kv[:m], kv[m:], h, kvh, attrs["scale"], mask, attrs.get("softcap"))


@_into(KERNELS, "attention_span")
def _attention_span(out, ins, attrs):
    # every group at once: keys stacked [groups, kv_heads, s, d], one batched product per key/value
    # head with its query heads as rows (grouped-query: no copy of keys per query head)
    q, span, kv = ins[0], ins[1], ins[2:]
    groups = attrs["groups"]
    m = len(kv) // 2 // groups
    h = attrs["heads"]
    kvh = attrs["kv_heads"] or h
    t, per = q.shape[0] // groups, h // kvh

    def stacked(tiles):  # -> [groups, kvh, s, d]
        if attrs.get("kv_bits") is None:
            x = torch.stack([torch.cat(tiles[g * m : (g + 1) * m], dim=0) for g in range(groups)])
        else:  # packed tiles (an int8 KV cache): dequantized straight into the stacked keys
            x = _dequant_stacked(tiles, groups, m, q.shape[1] // per, q.dtype, attrs)
        return x.unflatten(-1, (kvh, -1)).transpose(1, 2)

    k, v = stacked(kv[: groups * m]), stacked(kv[groups * m :])
    s, d = k.shape[2], k.shape[3]
    keys = torch.arange(s, device=q.device).unsqueeze(0) + attrs.get("start", 0)
    lo, hi = span[:, :1], span[:, 1:]
    # a row sees its span and always its own last key: a row with an empty span (padding) stays finite
    mask = ((keys >= lo) & seen(keys, hi, attrs.get("window", 0))) | (keys == hi)  # [groups*t, s]
    mask = mask.view(groups, 1, 1, t, s).expand(groups, 1, per, t, s).reshape(groups, 1, per * t, s)
    # query head kv_head * per + i uses key/value head kv_head (transformers' repeat_kv)
    qh = q.view(groups, t, kvh, per, d).permute(0, 2, 3, 1, 4).reshape(groups, kvh, per * t, d)
    sc = torch.matmul(qh, k.transpose(-1, -2)).mul_(attrs["scale"])
    if attrs.get("softcap") is not None:
        sc.div_(attrs["softcap"]).tanh_().mul_(attrs["softcap"])
    sc.masked_fill_(~mask, float("-inf"))
    o = torch.matmul(sc.softmax(-1), v)  # [groups, kvh, per*t, d]
    out.view(groups, t, kvh, per, d).copy_(o.view(groups, kvh, per, t, d).permute(0, 3, 1, 2, 4))


def _dequant_stacked(tiles, groups: int, m: int, width: int, dtype, attrs) -> torch.Tensor:
    """Packed key or value tiles (`quant`'s layout), m per group, as floats [groups, s, width]."""
    from .kernels_quant import dequant_tile  # at call: this module imports none of the project's

    s = sum(t.shape[0] for t in tiles[:m])
    x = torch.empty(groups, s, width, dtype=dtype, device=tiles[0].device)
    for g in range(groups):
        at = 0
        for t in tiles[g * m : (g + 1) * m]:
            dequant_tile(x[g, at : at + t.shape[0]], t, attrs["kv_bits"], attrs["kv_group"])
            at += t.shape[0]
    return x


@_into(KERNELS, "kv_write")
def _kv_write(out, ins, attrs):
    block, new, pos = ins
    if out.data_ptr() != block.data_ptr():
        out.copy_(block)
    if attrs.get("row") is not None:  # .get: vertices saved before the attribute existed
        new = new[attrs["row"] : attrs["row"] + 1]
    rows = torch.arange(new.shape[0], device=new.device) + (pos - attrs["start"])
    out.index_copy_(0, rows, new)


@_into(CHANGED, "kv_write")
def _kv_write_changed(out, ins, attrs):
    _, new, pos = ins
    if pos.numel() != 1:
        return 0, out.numel() * out.element_size()
    n = 1 if attrs.get("row") is not None else new.shape[0]
    row = out[0].numel() * out.element_size()
    first = int(pos) - attrs["start"]
    return first * row, (first + n) * row


@_into(KERNELS, "linear")
def _linear(out, ins, attrs):
    x, w = ins[:2]
    torch.matmul(x, w.t(), out=out)
    if attrs["scale"] != 1.0:
        out.mul_(attrs["scale"])
    if len(ins) == 3:
        out.add_(ins[2])


@_into(KERNELS, "embedding")
def _embedding(out, ins, attrs):
    ids, table = ins
    rows = table.shape[0]
    local = (ids - attrs["start"]).reshape(-1)
    inside = (local >= 0) & (local < rows)
    flat = out.view(-1, table.shape[1])  # ids [.., t]: one lookup of every id, rows in order
    torch.index_select(table, 0, local.clamp(0, rows - 1), out=flat)
    flat.mul_(inside.unsqueeze(1).to(out.dtype))
    if attrs.get("scale", 1.0) != 1.0:  # .get: vertices saved before the attribute existed
        flat.mul_(attrs["scale"])


# ---- temporaries (see `kernels.TEMPS`) --------------------------------------------------------
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@_into(TEMPS, "rope")
def _rope_temps(out, ins, attrs):
    return 2 * _nbytes(ins[0])  # the rotated half-swapped copy and the negated half


def _attention_temps(q: torch.Tensor, kv: list[torch.Tensor], attrs: Mapping, masked: bool) -> int:
    m = len(kv) // 2
    h = attrs["heads"]
    kvh = attrs["kv_heads"] or h
    t, s = q.shape[0], sum(k.shape[0] for k in kv[:m])
    d = q.shape[1] // h
    esz = q.element_size()
    kv_bytes = 2 * s * kvh * d * esz if m > 1 else 0  # the concatenated key and value tiles
    if kvh != h:
        kv_bytes += 2 * s * h * d * esz  # grouped heads repeated to every query head
    mask = t * s + 16 * (t + s) if masked else 0  # a boolean mask made from two aranges
    if attrs.get("softcap") is not None:  # the grouped product's mask, repeated per query head
        mask += t * s * (h // kvh)
    o = t * h * d * esz + t * h * 4  # SDPA's output and its log-sum-exp
    # the math fallback (masks the fused kernels refuse) materializes scores and probabilities
    scores = 2 * t * s * h * max(esz, 4)
    return kv_bytes + mask + o + scores


@_into(TEMPS, "attention")
def _attention_temps_op(out, ins, attrs):
    return _attention_temps(ins[0], ins[1:], attrs, attrs["causal"])


@_into(TEMPS, "attention_at")
def _attention_at_temps(out, ins, attrs):
    q, kv = ins[0], ins[2:]
    if attrs.get("kv_bits") is None:
        return _attention_temps(q, kv, attrs, True)
    # packed tiles: the float keys and values (as if concatenated), the dequantizing scratch
    h = attrs["heads"]
    width, s = q.shape[1] // h * (attrs["kv_heads"] or h), sum(k.shape[0] for k in kv[: len(kv) // 2])
    scratch = max(k.shape[0] for k in kv) * (4 * width + 16 * width // attrs["kv_group"] + 64)
    flat = torch.empty(s, 0, dtype=q.dtype)  # a tile of s rows: what the count reads of it
    return 2 * s * width * q.element_size() + scratch + _attention_temps(q, [flat, flat], attrs, True)


@_into(TEMPS, "attention_span")
def _attention_span_temps(out, ins, attrs):
    q, kv, groups = ins[0], ins[2:], attrs["groups"]
    h = attrs["heads"]
    s = sum(k.shape[0] for k in kv[: len(kv) // 2]) // groups
    t, d, esz = q.shape[0], q.shape[1] // h, q.element_size()
    kvh = attrs["kv_heads"] or h
    kv_bytes = 2 * groups * s * kvh * d * esz  # the stacked keys and values
    if attrs.get("kv_bits") is not None:  # dequantizing a packed tile: its float32 rows, scales
        kv_bytes += max(k.shape[0] for k in kv) * (4 * kvh * d + 16 * kvh * d // attrs["kv_group"] + 64)
    # the mask (two aranges' compares, its per-head copy), scores and probabilities, the output
    return kv_bytes + t * s * (2 + 2 * 8 + h) + 2 * t * s * h * max(esz, 4) + t * h * d * esz


@_into(TEMPS, "kv_write")
def _kv_write_temps(out, ins, attrs):
    return 8 * ins[1].shape[0]  # the row indices


@_into(TEMPS, "embedding")
def _embedding_temps(out, ins, attrs):
    ids = ins[0].numel()
    return 3 * 8 * ids + out.shape[0] * out.element_size()  # shifted, clamped ids, mask, its cast
