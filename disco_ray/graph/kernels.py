"""Torch implementations of the op set, each writing its result into a given output view.

The same code runs on CPU tensors and on CUDA views of a GPU arena. An implementation may use
temporaries (torch's allocator), but never resizes or reallocates `out`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

from . import ops
from .kernels_act import KERNELS as ACT_KERNELS
from .kernels_act import TEMPS as ACT_TEMPS
from .kernels_attn_grad import KERNELS as ATTN_GRAD_KERNELS
from .kernels_attn_grad import TEMPS as ATTN_GRAD_TEMPS
from .kernels_conv import KERNELS as CONV_KERNELS
from .kernels_conv import TEMPS as CONV_TEMPS
from .kernels_headnorm import KERNELS as HEADNORM_KERNELS
from .kernels_headnorm import TEMPS as HEADNORM_TEMPS
from .kernels_llm import CHANGED as CHANGED
from .kernels_llm import KERNELS as LLM_KERNELS
from .kernels_llm import TEMPS as LLM_TEMPS
from .kernels_mask import KERNELS as MASK_KERNELS
from .kernels_mask import TEMPS as MASK_TEMPS
from .kernels_math import KERNELS as MATH_KERNELS
from .kernels_math import TEMPS as MATH_TEMPS
from .kernels_moe import KERNELS as MOE_KERNELS
from .kernels_nn import KERNELS as NN_KERNELS
from .kernels_nn import TEMPS as NN_TEMPS
from .kernels_optim import KERNELS as OPTIM_KERNELS
from .kernels_quant import KERNELS as QUANT_KERNELS
from .kernels_quant import TEMPS as QUANT_TEMPS
from .kernels_sample import KERNELS as SAMPLE_KERNELS
from .kernels_sample import TEMPS as SAMPLE_TEMPS
from .kernels_train import KERNELS as TRAIN_KERNELS

Impl = Callable[[torch.Tensor, list[torch.Tensor], Mapping], None]
# the op families' kernels live beside them: kernels_llm (transformer ops), kernels_nn (general
# ops), kernels_train (training ops), kernels_attn_grad (the fused attention backward),
# kernels_optim (gradient clipping), kernels_sample (token choice), kernels_act (the activations and soft-capping of families beyond LLaMA),
# kernels_headnorm (per-head RMSNorm), kernels_moe (the mixture-of-experts ops), kernels_quant
# (quantization, dequantization), kernels_mask (masks and positions), kernels_math (elementwise math),
# kernels_conv (the CNN ops and the rest of ops_math); this module has those of the base op set (`ops`)
IMPLS: dict[str, Impl] = {
    **LLM_KERNELS,
    **NN_KERNELS,
    **TRAIN_KERNELS,
    **ATTN_GRAD_KERNELS,
    **OPTIM_KERNELS,
    **SAMPLE_KERNELS,
    **ACT_KERNELS,
    **HEADNORM_KERNELS,
    **MOE_KERNELS,
    **QUANT_KERNELS,
    **MASK_KERNELS,
    **MATH_KERNELS,
    **CONV_KERNELS,
}


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
    offset = attrs.get("offset", 0.0)  # .get: vertices saved before the attribute existed
    if w is not None and offset:  # Gemma: normalized in float32, times (offset + w) in float32
        x = ins[0]
        out.copy_(F.rms_norm(x.float(), x.shape[-1:], None, attrs["eps"]) * (w.float() + offset))
        return
    out.copy_(F.rms_norm(ins[0], ins[0].shape[-1:], w, attrs["eps"]))


@impl("transpose")
def _transpose(out, ins, attrs):
    out.copy_(ins[0].transpose(-1, -2))


@impl("reduce_sum")
def _reduce_sum(out, ins, attrs):
    out.copy_(ins[0].float().sum().mul(attrs["scale"]).reshape(1))


# ---- temporaries -----------------------------------------------------------------------------------
# What an op's implementation may allocate while it runs (torch's caching allocator), in bytes,
# an upper bound on CUDA: the backend keeps that much ready on each compute stream before a run,
# so no kernel calls cudaMalloc mid-run (TURNIP section 5: no allocation while a graph runs).
# Ops not listed write `out` in place (out= variants, copy_) and allocate nothing; an op added
# elsewhere without an entry is assumed to need one output-sized temporary.
TempBytes = Callable[[torch.Tensor, list[torch.Tensor], Mapping], int]
TEMPS: dict[str, TempBytes] = {
    **LLM_TEMPS,
    **NN_TEMPS,
    **SAMPLE_TEMPS,
    **ACT_TEMPS,
    **HEADNORM_TEMPS,
    **QUANT_TEMPS,
    **ATTN_GRAD_TEMPS,
    **MASK_TEMPS,
    **MATH_TEMPS,
    **CONV_TEMPS,
}
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
    # with a weight offset (Gemma) the product with (offset + w) in float32 is one more
    return _nbytes(out) + (4 if attrs.get("offset") else 3) * ins[0].numel() * 4


# the op set as this package defines it: ops registered later (one's own, actors.testops) are
# shipped to the workers with the graph that uses them
BUILTIN: frozenset[str] = frozenset(IMPLS)
