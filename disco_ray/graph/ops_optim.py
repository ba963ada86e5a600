"""The optimizer ops: AdamW and SGD steps, and global gradient-norm clipping.

The learning rate of a step is `lr * factor`, `factor` an optional input (one float64's bits in an
int64 [1], `kernels_sample.as_bits`: graphs hold no float64): a schedule changes it step by step
without re-planning, and the product is the one `torch.optim.lr_scheduler.LambdaLR` computes
(`base_lr * lambda(step)`), so the update equals torch's bit for bit. Clipping follows
`torch.nn.utils.clip_grad_norm_`: `sum_squares` per gradient, their sum on one GPU, `clip_coef`
(the norm and min(1, max_norm / (norm + 1e-6))), `scale_grad` per gradient. Kernels in
`kernels_train`.
"""

from __future__ import annotations

from .ops_train import INTS, _number
from .opspec import REQUIRED, OpSpec, _same_dtype, elementwise, numel, register


def _factor(name: str, shape, dtype: str) -> None:
    if shape != (1,) or dtype != "int64":
        raise ValueError(f"{name}: lr factor must be int64 [1] (a float64's bits), got {list(shape)} {dtype}")


def _infer_adamw(shapes, dtypes, attrs):
    name = "adamw"
    state, grad, step = shapes[:3]
    _number(name, attrs, "lr", lo=0.0)
    _number(name, attrs, "beta1", lo=0.0, below=1.0)
    _number(name, attrs, "beta2", lo=0.0, below=1.0)
    _number(name, attrs, "eps", lo=0.0)
    _number(name, attrs, "weight_decay", lo=0.0)
    if not grad or not state or state != (3 * grad[0], *grad[1:]):
        raise ValueError(
            f"{name}: state must be [3*r, ..] (param, exp_avg, exp_avg_sq) for grad [r, ..], "
            f"got {list(state)} and {list(grad)}"
        )
    if step != (1,) or dtypes[2] not in (*INTS, "float32"):
        raise ValueError(f"{name}: step must be an int or float32 tensor [1], got {list(step)} {dtypes[2]}")
    if len(shapes) == 4:
        _factor(name, shapes[3], dtypes[3])
    return state, _same_dtype(name, dtypes[:2])


def _infer_sgd(shapes, dtypes, attrs):
    _number("sgd", attrs, "lr", lo=0.0)
    _number("sgd", attrs, "weight_decay", lo=0.0)
    if shapes[0] != shapes[1]:
        raise ValueError(f"sgd: param {list(shapes[0])} and grad {list(shapes[1])} differ in shape")
    if len(shapes) == 3:
        _factor("sgd", shapes[2], dtypes[2])
    return shapes[0], _same_dtype("sgd", dtypes[:2])


def _infer_sum_squares(shapes, dtypes, attrs):
    _same_dtype("sum_squares", dtypes)
    return (1,), "float32"


def _infer_clip_coef(shapes, dtypes, attrs):
    _number("clip_coef", attrs, "max_norm", lo=0.0)
    if any(s != (1,) for s in shapes) or any(d != "float32" for d in dtypes):
        raise ValueError(f"clip_coef: sums of squares must be float32 [1], got {[list(s) for s in shapes]}")
    return (2,), "float32"


def _infer_scale_grad(shapes, dtypes, attrs):
    if shapes[1] != (2,) or dtypes[1] != "float32":
        raise ValueError(
            f"scale_grad: clip must be float32 [2] (clip_coef's), got {list(shapes[1])} {dtypes[1]}"
        )
    return shapes[0], _same_dtype("scale_grad", dtypes[:1])


register(
    OpSpec(
        "adamw",
        3,
        4,
        _infer_adamw,
        attrs={"lr": REQUIRED, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
        flops=lambda s, o, a: 14.0 * numel(s[1]),
        doc="one torch.optim.AdamW step: state [3*r, ..] (param, exp_avg, exp_avg_sq stacked), grad "
        "[r, ..], step [1] (int or float32: the step number t >= 1, read on the device), optional lr "
        "factor [1] (int64: a float64's bits; the step's lr is lr * factor) -> the new state (may be "
        "written in place)",
    )
)
register(
    OpSpec(
        "sgd",
        2,
        3,
        _infer_sgd,
        attrs={"lr": REQUIRED, "weight_decay": 0.0},
        flops=elementwise(3),
        doc="one torch.optim.SGD step without momentum: param - lr * (grad + weight_decay * param); "
        "optional lr factor [1] (int64: a float64's bits; the step's lr is lr * factor)",
    )
)
register(
    OpSpec(
        "sum_squares",
        1,
        1,
        _infer_sum_squares,
        flops=elementwise(2),
        doc="the sum of x's squares in float32 -> [1] (a gradient's squared L2 norm)",
    )
)
register(
    OpSpec(
        "clip_coef",
        1,
        None,
        _infer_clip_coef,
        attrs={"max_norm": REQUIRED},
        flops=lambda s, o, a: float(len(s)),
        doc="sums of squares [1] each (float32) -> [2]: the global L2 norm and min(1, max_norm / "
        "(norm + 1e-6)), as torch.nn.utils.clip_grad_norm_ computes them",
    )
)
register(
    OpSpec(
        "scale_grad",
        2,
        2,
        _infer_scale_grad,
        flops=elementwise(1),
        doc="grad, clip [2] (clip_coef's) -> grad * clip[1] in grad's dtype (clip_grad_norm_'s scaling)",
    )
)
