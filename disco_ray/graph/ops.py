"""The op set: each op's arity, attributes and shape/dtype inference (pure, no torch).

The torch implementations live in `disco_ray.graph.kernels`; they write into a given output view so
the runtime can run them on arena views on the CPU or a GPU. An op of one's own registers with
`register(OpSpec(...))` here and `kernels.impl(name)` there (see README, "Your own op"). This module
registers FORMATS.md's ops and the elementwise and normalisation ops; `ops_llm` the transformer
ops (rotary embedding, attention, KV cache writes, linear layers, embedding lookups); `ops_nn`
the general ops a torch model maps onto (activations, layer norm, broadcasting arithmetic, shape
copies, reductions); `ops_train` the training ops (backward of the layers, cross-entropy);
`ops_optim` the optimizer steps and gradient clipping; `ops_sample` the token choice (`sample_tokens`, `finished_rows`); `ops_act` the
activations and soft-capping of families beyond LLaMA (`gelu_tanh`, `softcap`, their backward);
`ops_attn_grad` the fused attention backward of a query tile;
`ops_headnorm` the per-head RMSNorm of queries and keys and its backward; `ops_moe` the
mixture-of-experts ops (routing, combining, their backward); `ops_quant` the dequantization of
packed weights (`dequant`); `ops_mask` the integer and boolean ops of masks and positions
(comparisons, logical ops, `where`, `index`, `expand`, `sdpa_mask`); `ops_conv` the
convolutional-network ops (conv, batch and group norm, pooling); `ops_math` elementwise math,
powers, cumsum and `full` (`rsqrt`, `sqrt`, `exp`, `sin`, `cos`, log_softmax, leaky_relu, hardswish).
"""

from __future__ import annotations

from . import (
    ops_act,
    ops_attn_grad,
    ops_conv,
    ops_headnorm,
    ops_llm,
    ops_mask,
    ops_math,
    ops_moe,
    ops_nn,
    ops_optim,
    ops_quant,
    ops_sample,
    ops_train,
)
from .ops_llm import attention_pairs
from .opspec import (
    BUILTIN,
    OPS,
    REQUIRED,
    OpSpec,
    Shape,
    _broadcast,
    _same_dtype,
    elementwise,
    get,
    no_flops,
    numel,
    reduce_flops,
    register,
    sum_flops,
)

__all__ = [
    "OPS",
    "REQUIRED",
    "OpSpec",
    "Shape",
    "attention_pairs",
    "get",
    "numel",
    "ops_act",
    "ops_attn_grad",
    "ops_conv",
    "ops_headnorm",
    "ops_llm",
    "ops_mask",
    "ops_math",
    "ops_moe",
    "ops_nn",
    "ops_optim",
    "ops_quant",
    "ops_sample",
    "ops_train",
    "register",
]


def _infer_matmul(shapes, dtypes, attrs):
    a, b = shapes
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"matmul needs operands of rank >= 2, got {list(a)} and {list(b)}")
    if a[-1] != b[-2]:
        raise ValueError(f"matmul inner dims differ: {list(a)} @ {list(b)}")
    batch = _broadcast(a[:-2], b[:-2])
    return (*batch, a[-2], b[-1]), _same_dtype("matmul", dtypes)


def _flops_matmul(shapes, out, attrs):
    return 2.0 * numel(out) * shapes[0][-1]


def _infer_same_shape(name: str, floats: bool = False):
    def infer(shapes, dtypes, attrs):
        if len(set(shapes)) != 1:
            raise ValueError(f"{name} operands have different shapes {[list(s) for s in shapes]}")
        return shapes[0], _same_dtype(name, dtypes, floats=floats)

    return infer


def _infer_broadcast(name: str):
    def infer(shapes, dtypes, attrs):
        return ops_nn.broadcast(name, shapes), _same_dtype(name, dtypes, floats=False)

    return infer


def _infer_unary_float(name: str, min_rank: int = 0):
    def infer(shapes, dtypes, attrs):
        (s,) = shapes[:1]
        if len(s) < min_rank:
            raise ValueError(f"{name} needs rank >= {min_rank}, got shape {list(s)}")
        return s, _same_dtype(name, dtypes[:1])

    return infer


def _infer_softmax(shapes, dtypes, attrs):
    (s,) = shapes
    if not s:
        raise ValueError("softmax needs rank >= 1, got a scalar")
    ops_nn.reduced_axes("softmax", s, [attrs["axis"]])
    return s, _same_dtype("softmax", dtypes)


def _infer_rmsnorm(shapes, dtypes, attrs):
    x = shapes[0]
    if not x:
        raise ValueError("rmsnorm needs rank >= 1")
    if len(shapes) == 2 and shapes[1] != (x[-1],):
        raise ValueError(f"rmsnorm weight must have shape [{x[-1]}], got {list(shapes[1])}")
    return x, _same_dtype("rmsnorm", dtypes)


def _infer_transpose(shapes, dtypes, attrs):
    (s,) = shapes
    if len(s) < 2:
        raise ValueError(f"transpose needs rank >= 2, got shape {list(s)}")
    return (*s[:-2], s[-1], s[-2]), dtypes[0]


register(
    OpSpec(
        "matmul", 2, 2, _infer_matmul, flops=_flops_matmul, doc="a [.., m, k] @ b [.., k, n] -> [.., m, n]"
    )
)
register(
    OpSpec(
        "add",
        1,
        None,
        _infer_broadcast("add"),
        flops=sum_flops,
        doc="elementwise sum of 1 or more tensors of one shape, or of shapes that broadcast as numpy's "
        "do (a bias b [n] added to x [.., n])",
    )
)
register(
    OpSpec(
        "mul",
        2,
        2,
        _infer_broadcast("mul"),
        flops=elementwise(1),
        doc="elementwise product a * b (shapes broadcast as numpy's do)",
    )
)
register(
    OpSpec(
        "scale",
        1,
        1,
        _infer_unary_float("scale"),
        attrs={"factor": REQUIRED},
        flops=elementwise(1),
        doc="x * factor",
    )
)
register(
    OpSpec(
        "softmax",
        1,
        1,
        _infer_softmax,
        attrs={"axis": -1},
        flops=elementwise(5),
        doc="softmax over dim axis (the last by default)",
    )
)
register(OpSpec("silu", 1, 1, _infer_unary_float("silu"), flops=elementwise(4), doc="x * sigmoid(x)"))
register(
    OpSpec(
        "rmsnorm",
        1,
        2,
        _infer_rmsnorm,
        attrs={"eps": 1e-6, "offset": 0.0},
        flops=elementwise(4),
        doc="x / sqrt(mean(x^2, last dim) + eps) [* (w + offset)]; offset 1: Gemma's norm, scaled by "
        "1 + w in float32",
    )
)
register(OpSpec("transpose", 1, 1, _infer_transpose, flops=no_flops, doc="swap the last two dims"))


def _infer_reduce_sum(shapes, dtypes, attrs):
    sc = attrs["scale"]
    if isinstance(sc, bool) or not isinstance(sc, (int, float)):
        raise ValueError(f"reduce_sum: attribute scale must be a number, got {sc!r}")
    return (1,), _same_dtype("reduce_sum", dtypes[:1])


register(
    OpSpec(
        "reduce_sum",
        1,
        1,
        _infer_reduce_sum,
        attrs={"scale": 1.0},
        flops=reduce_flops,
        doc="scale * the sum of every element of x, as a tensor [1] (summed in float32)",
    )
)


register(
    OpSpec(
        "accumulate",
        1,
        None,
        _infer_same_shape("accumulate"),
        flops=sum_flops,
        doc="the sum of 1 or more tensors of one shape, which a plan may compute as sum-into kernels: one "
        "per operand, each adding its operand into the sum as soon as it exists, in any order, one at a "
        "time (TURNIP appendix A)",
    )
)

BUILTIN.update(OPS)  # every op registered so far is built in: its attributes follow ATTR_TYPES
