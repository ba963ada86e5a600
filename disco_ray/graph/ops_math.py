"""Elementwise math of floating tensors a torch model applies outside its layers: `rsqrt`
(RMSNorm written out), `sqrt`, `exp`, `sin` and `cos` (rotary tables). Pure: arity, shape/dtype
inference, FLOPs; kernels live in `kernels_math`.
"""

from __future__ import annotations

from .opspec import OpSpec, _same_dtype, elementwise, register

UNARY = {"rsqrt": "1 / sqrt(x)", "sqrt": "sqrt(x)", "exp": "e^x", "sin": "sin(x)", "cos": "cos(x)"}


def _infer(name: str):
    def infer(shapes, dtypes, attrs):
        return shapes[0], _same_dtype(name, dtypes)

    return infer


for _name, _doc in UNARY.items():
    register(OpSpec(_name, 1, 1, _infer(_name), flops=elementwise(4), doc=f"{_doc} elementwise"))

__all__ = ["UNARY"]
