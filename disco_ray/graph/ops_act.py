"""The activations and soft-capping of model families beyond LLaMA, with their backward: the tanh
approximation of GELU (`gelu_tanh`, Gemma's `gelu_pytorch_tanh`) and logit soft-capping
(`softcap`: cap * tanh(x / cap), Gemma 2's final logits). Pure: arity, attributes, shape/dtype
inference, FLOPs; kernels live in `kernels_act`.
"""

from __future__ import annotations

import math

from .opspec import REQUIRED, OpSpec, _same_dtype, elementwise, register


def _infer_unary(name: str):
    def infer(shapes, dtypes, attrs):
        if name.startswith("softcap"):
            cap = attrs["cap"]
            if (
                isinstance(cap, bool)
                or not isinstance(cap, (int, float))
                or not (math.isfinite(cap) and cap > 0)
            ):
                raise ValueError(f"{name}: attribute cap must be a positive finite number, got {cap!r}")
        if len(shapes) == 2 and shapes[0] != shapes[1]:
            raise ValueError(f"{name} operands have different shapes {[list(s) for s in shapes]}")
        return shapes[0], _same_dtype(name, dtypes)

    return infer


register(
    OpSpec(
        "gelu_tanh",
        1,
        1,
        _infer_unary("gelu_tanh"),
        flops=elementwise(8),
        doc="0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): GELU's tanh approximation "
        "(torch's gelu(approximate='tanh'), transformers' gelu_pytorch_tanh)",
    )
)
register(
    OpSpec(
        "gelu_tanh_grad",
        2,
        2,
        _infer_unary("gelu_tanh_grad"),
        flops=elementwise(12),
        doc="dh * gelu_tanh'(a) for a, dh of one shape (aten's gelu_backward, approximate='tanh')",
    )
)
register(
    OpSpec(
        "softcap",
        1,
        1,
        _infer_unary("softcap"),
        attrs={"cap": REQUIRED},
        flops=elementwise(6),
        doc="cap * tanh(x / cap): logits soft-capped into (-cap, cap) (Gemma 2's "
        "final_logit_softcapping), computed as transformers does: divide, tanh, multiply",
    )
)
register(
    OpSpec(
        "softcap_grad",
        2,
        2,
        _infer_unary("softcap_grad"),
        attrs={"cap": REQUIRED},
        flops=elementwise(4),
        doc="dx of y = softcap(x) from y (the capped values) and dy: dy * (1 - (y / cap)^2)",
    )
)
