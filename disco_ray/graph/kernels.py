"""Torch implementations of the op set, each writing its result into a given output view.

The same code runs on CPU tensors and on CUDA views of a GPU arena. An implementation may use
temporaries (torch's allocator), but never resizes or reallocates `out`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

from . import ops
from .kernels_nn import KERNELS as NN_KERNELS
from .kernels_nn import TEMPS as NN_TEMPS
from .kernels_train import KERNELS as TRAIN_KERNELS

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
# the general ops' kernels live in kernels_nn, the training ops' in kernels_train
IMPLS: dict[str, Impl] = {**NN_KERNELS, **TRAIN_KERNELS}


def impl(name: str):
    """Decorator: `fn(out, ins, attrs)` is op `name`'s kernel (README, "Your own op")."""

    def deco(fn: Impl) -> Impl:
        IMPLS[name] = fn
        return fn

    return deco


def unregister(name: str) -> None:
    """Takes op `name` out of the op, kernel and temporaries registries (tests, notebooks)."""
    ops.OPS.pop(name, None)
    IMPLS.pop(name, None)
    TEMPS.pop(name, None)


def missing_kernels(used: Iterable[str]) -> list[str]:
    """The ops of `used` that are registered but have no kernel here."""
    return sorted({op for op in used if op not in IMPLS})


def own_ops(used: Iterable[str]) -> dict[str, tuple]:
    """(spec, kernel, temporaries bound or None) of each op of `used` registered after the
    built-in op set: what a worker in another process must be given (`install_ops`)."""
    return {
        op: (ops.OPS[op], IMPLS[op], TEMPS.get(op))
        for op in sorted(set(used))
        if op not in BUILTIN and op in ops.OPS and op in IMPLS
    }


def install_ops(found: Mapping[str, tuple]) -> None:
    """Registers ops shipped by `own_ops` (a worker's side); a newer definition replaces one of
    the same name."""
    for name, (spec, fn, temps) in found.items():
        ops.register(spec)
        IMPLS[name] = fn
        if temps is not None:
            TEMPS[name] = temps


def run_kernel(op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> None:
    """Runs `op` on `ins`, writing into `out` (shape and dtype as the op infers)."""
    IMPLS[op](out, ins, ops.OPS[op].full_attrs(attrs))


@impl("matmul")
def _matmul(out, ins, attrs):
    torch.matmul(ins[0], ins[1], out=out)


@impl("accumulate")
@impl("add")
def _add(out, ins, attrs):
    if len(ins) == 1:
        out.copy_(ins[0])
        return
    torch.add(ins[0], ins[1], out=out)
    for x in ins[2:]:
        out.add_(x)


@impl("mul")
def _mul(out, ins, attrs):
    torch.mul(ins[0], ins[1], out=out)


@impl("scale")
def _scale(out, ins, attrs):
    torch.mul(ins[0], attrs["factor"], out=out)


@impl("softmax")
def _softmax(out, ins, attrs):
    torch.ops.aten._softmax.out(ins[0], attrs.get("axis", -1), False, out=out)


@impl("silu")
def _silu(out, ins, attrs):
    torch.ops.aten.silu.out(ins[0], out=out)


@impl("rmsnorm")
def _rmsnorm(out, ins, attrs):
    # one fused kernel on CUDA (few host calls: a kernel's host time counts when tiles are small);
    # low-precision inputs are normalized in float32, as LLaMA does
    w = ins[1] if len(ins) == 2 else None
    out.copy_(F.rms_norm(ins[0], ins[0].shape[-1:], w, attrs["eps"]))


@impl("transpose")
def _transpose(out, ins, attrs):
    out.copy_(ins[0].transpose(-1, -2))


# ---- kernels of the workload ops (concat, rope, attention) -------------------------------------
@impl("concat")
def _concat(out, ins, attrs):
    torch.cat(ins, dim=attrs["axis"], out=out)


@impl("rope")
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


def _sdpa(out, q, ks, vs, h: int, kvh: int, scale: float, mask) -> None:
    """softmax(q k^T * scale + mask) v per head, written into out [t, h*d]; k/v tiles [t_j, kvh*d]
    (grouped-query attention when kvh < h: each key/value head serves h/kvh query heads)."""
    from torch.nn.functional import scaled_dot_product_attention

    def heads(x, n):  # [rows, n*d] -> [1, n, rows, d], the layout the fused kernels take
        return x.unflatten(-1, (n, -1)).transpose(0, 1).unsqueeze(0)

    k = heads(ks[0] if len(ks) == 1 else torch.cat(ks, dim=0), kvh)
    v = heads(vs[0] if len(vs) == 1 else torch.cat(vs, dim=0), kvh)
    t, g = q.shape[0], h // kvh
    if g > 1 and t * g <= 64:
        # a few query rows (a decode step): each key/value head's group of query heads in one
        # product, instead of copying keys and values per query head for the fused kernel
        qg = q.unflatten(-1, (kvh, g, -1)).permute(1, 2, 0, 3).reshape(kvh, g * t, -1)
        sc = torch.matmul(qg, k[0].transpose(-1, -2)).mul_(scale)
        if mask is not None:
            sc.masked_fill_(~mask.repeat(g, 1), float("-inf"))
        o = torch.matmul(sc.softmax(-1), v[0])  # [kvh, g*t, d]
        out.unflatten(-1, (kvh, g, -1)).copy_(o.unflatten(1, (g, t)).permute(2, 0, 1, 3))
        return
    if kvh != h:
        k, v = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
    o = scaled_dot_product_attention(heads(q, h), k, v, attn_mask=mask, scale=scale)
    out.unflatten(-1, (h, -1)).copy_(o[0].transpose(0, 1))


@impl("attention")
def _attention(out, ins, attrs):
    q, kv = ins[0], ins[1:]
    m = len(kv) // 2
    h = attrs["heads"]
    kvh = attrs["kv_heads"] or h
    t, s = q.shape[0], sum(k.shape[0] for k in kv[:m])
    mask = None
    if attrs["causal"] and attrs["offset"] == s - t and q.is_cuda:
        # a query tile ending at the last key: the fused causal kernels (importing the bias
        # module costs ~2 s once, which the cpu backend, with no fused kernel to gain, skips)
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(t, s)
    elif attrs["causal"]:
        rows = torch.arange(t, device=q.device).unsqueeze(1) + attrs["offset"]
        mask = torch.arange(s, device=q.device).unsqueeze(0) <= rows
    _sdpa(out, q, kv[:m], kv[m:], h, kvh, attrs["scale"], mask)


@impl("attention_at")
def _attention_at(out, ins, attrs):
    # the mask is made on the device from pos: a decode step never waits for the host
    q, pos, kv = ins[0], ins[1], ins[2:]
    m = len(kv) // 2
    h = attrs["heads"]
    t, s = q.shape[0], sum(k.shape[0] for k in kv[:m])
    rows = torch.arange(t, device=q.device).unsqueeze(1) + pos
    mask = torch.arange(s, device=q.device).unsqueeze(0) <= rows
    _sdpa(out, q, kv[:m], kv[m:], h, attrs["kv_heads"] or h, attrs["scale"], mask)


@impl("kv_write")
def _kv_write(out, ins, attrs):
    block, new, pos = ins
    if out.data_ptr() != block.data_ptr():
        out.copy_(block)
    rows = torch.arange(new.shape[0], device=new.device) + (pos - attrs["start"])
    out.index_copy_(0, rows, new)


@impl("linear")
def _linear(out, ins, attrs):
    x, w = ins[:2]
    torch.matmul(x, w.t(), out=out)
    if attrs["scale"] != 1.0:
        out.mul_(attrs["scale"])
    if len(ins) == 3:
        out.add_(ins[2])


@impl("reduce_sum")
def _reduce_sum(out, ins, attrs):
    out.copy_(ins[0].float().sum().mul(attrs["scale"]).reshape(1))


@impl("embedding")
def _embedding(out, ins, attrs):
    ids, table = ins
    rows = table.shape[0]
    local = (ids - attrs["start"]).reshape(-1)
    inside = (local >= 0) & (local < rows)
    flat = out.view(-1, table.shape[1])  # ids [.., t]: one lookup of every id, rows in order
    torch.index_select(table, 0, local.clamp(0, rows - 1), out=flat)
    flat.mul_(inside.unsqueeze(1).to(out.dtype))


# ---- temporaries -----------------------------------------------------------------------------------
# What an implementation above may allocate while it runs (torch's caching allocator), in bytes,
# an upper bound on CUDA: the backend keeps that much ready on each compute stream before a run,
# so no kernel calls cudaMalloc mid-run (TURNIP section 5: no allocation while a graph runs).
# Ops not listed write `out` in place (out= variants, copy_) and allocate nothing; an op added
# elsewhere without an entry is assumed to need one output-sized temporary.
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]
TEMPS: dict[str, TempBytes] = dict(NN_TEMPS)
IN_PLACE = frozenset({"matmul", "add", "mul", "scale", "softmax", "silu", "transpose", "concat", "linear"})


def temp_bytes(op: str, out: torch.Tensor, ins: list[torch.Tensor], attrs: Mapping) -> int:
    """Upper bound of the bytes `op`'s implementation allocates besides `out` (see TEMPS)."""
    if op in IN_PLACE:
        return 0
    fn = TEMPS.get(op)
    return _nbytes(out) if fn is None else fn(out, ins, attrs)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _temps(name: str):
    def deco(fn: TempBytes) -> TempBytes:
        TEMPS[name] = fn
        return fn

    return deco


@_temps("rmsnorm")
def _rmsnorm_temps(out, ins, attrs):
    # F.rms_norm's result, plus what its unfused form makes (a float32 copy, its square, the
    # normalized product): fused on CUDA it needs only the first
    return _nbytes(out) + 3 * ins[0].numel() * 4


@_temps("rope")
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
    o = t * h * d * esz + t * h * 4  # SDPA's output and its log-sum-exp
    # the math fallback (masks the fused kernels refuse) materializes scores and probabilities
    scores = 2 * t * s * h * max(esz, 4)
    return kv_bytes + mask + o + scores


@_temps("attention")
def _attention_temps_op(out, ins, attrs):
    return _attention_temps(ins[0], ins[1:], attrs, attrs["causal"])


@_temps("attention_at")
def _attention_at_temps(out, ins, attrs):
    return _attention_temps(ins[0], ins[2:], attrs, True)


@_temps("kv_write")
def _kv_write_temps(out, ins, attrs):
    return 8 * ins[1].shape[0]  # the row indices


@_temps("embedding")
def _embedding_temps(out, ins, attrs):
    ids = ins[0].numel()
    return 3 * 8 * ids + out.shape[0] * out.element_size()  # shifted, clamped ids, mask, its cast


# the op set as this package defines it: ops registered later (one's own, actors.testops) are
# shipped to the workers with the graph that uses them
BUILTIN: frozenset[str] = frozenset(IMPLS)
