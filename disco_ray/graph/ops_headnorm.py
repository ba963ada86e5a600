"""RMSNorm of each attention head (Qwen3's q_norm and k_norm) and its backward (pure, no torch).

x [.., heads*d] is normalized per head, over each run of d columns, and scaled by one weight
[d] shared by the heads: transformers' RMSNorm of q.view(.., heads, d). The head width is the
weight's length, so a GPU's block of heads uses the same op. Kernels live in `kernels_headnorm`.
"""

from __future__ import annotations

from .opspec import OpSpec, _same_dtype, elementwise, register


def _heads_of(name: str, x, w) -> None:
    if not x or len(w) != 1 or x[-1] % w[0]:
        raise ValueError(
            f"{name} needs x [.., heads*d] and w [d] with d dividing x's last dim, got {list(x)} and {list(w)}"
        )


def _infer_head_rmsnorm(shapes, dtypes, attrs):
    x, w = shapes
    _heads_of("head_rmsnorm", x, w)
    return x, _same_dtype("head_rmsnorm", dtypes)


def _infer_head_rmsnorm_grad(shapes, dtypes, attrs):
    x, w, dy = shapes
    _heads_of("head_rmsnorm_grad", x, w)
    if dy != x:
        raise ValueError(f"head_rmsnorm_grad: dy {list(dy)} must be shaped as x {list(x)}")
    return x, _same_dtype("head_rmsnorm_grad", dtypes)


register(
    OpSpec(
        "head_rmsnorm",
        2,
        2,
        _infer_head_rmsnorm,
        attrs={"eps": 1e-6},
        flops=elementwise(4),
        doc="x [.., heads*d] normalized per head, each d columns / sqrt(mean of their squares + eps), "
        "times w [d] (the per-head RMSNorm of queries and keys: Qwen3's q_norm, k_norm)",
    )
)
register(
    OpSpec(
        "head_rmsnorm_grad",
        3,
        3,
        _infer_head_rmsnorm_grad,
        attrs={"eps": 1e-6},
        flops=elementwise(8),
        doc="dx of y = head_rmsnorm(x, w) for x [.., heads*d], w [d] (frozen), dy shaped as x: "
        "rmsnorm_grad per head, in float32",
    )
)
