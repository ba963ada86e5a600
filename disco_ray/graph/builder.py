"""The TaskGraph builder's op methods: one short method per common op, each a `kernel` call.

`TaskGraph` inherits them; every method returns the new vertex's id, takes the operands' ids
first, and accepts `gpu=` and `id=` like `TaskGraph.kernel` (the GPU defaults to the first
operand's). Any registered op, one's own included, is also reachable as `g.kernel("op", ...)`.
"""

from __future__ import annotations

from collections.abc import Sequence


class OpMethods:
    """Mixin of `TaskGraph`: `kernel` is the one method it needs."""

    def kernel(self, op: str, *inputs: str, gpu: int | None = None, id: str | None = None, **attrs) -> str:
        raise NotImplementedError

    # ---- FORMATS.md and elementwise ----------------------------------------------------------
    def matmul(self, a: str, b: str, **kw) -> str:
        return self.kernel("matmul", a, b, **kw)

    def add(self, *xs: str, **kw) -> str:
        """The sum of the operands (shapes broadcast: `g.add(x, bias)` adds bias [n] to x [.., n])."""
        return self.kernel("add", *xs, **kw)

    def sub(self, a: str, b: str, **kw) -> str:
        return self.kernel("sub", a, b, **kw)

    def mul(self, a: str, b: str, **kw) -> str:
        return self.kernel("mul", a, b, **kw)

    def div(self, a: str, b: str, **kw) -> str:
        return self.kernel("div", a, b, **kw)

    def scale(self, x: str, factor: float, **kw) -> str:
        return self.kernel("scale", x, factor=float(factor), **kw)

    def add_scalar(self, x: str, value: float, **kw) -> str:
        return self.kernel("add_scalar", x, value=float(value), **kw)

    # ---- activations and norms ----------------------------------------------------------------
    def relu(self, x: str, **kw) -> str:
        return self.kernel("relu", x, **kw)

    def gelu(self, x: str, approximate: str = "none", **kw) -> str:
        """GELU, exact (`approximate="none"`) or its tanh form (`"tanh"`), as F.gelu."""
        return self.kernel("gelu", x, approximate=approximate, **kw)

    def silu(self, x: str, **kw) -> str:
        return self.kernel("silu", x, **kw)

    def softmax(self, x: str, axis: int = -1, **kw) -> str:
        return self.kernel("softmax", x, axis=axis, **kw)

    def rmsnorm(self, x: str, w: str | None = None, eps: float = 1e-6, **kw) -> str:
        return self.kernel("rmsnorm", *((x,) if w is None else (x, w)), eps=float(eps), **kw)

    def layernorm(self, x: str, w: str | None = None, b: str | None = None, eps: float = 1e-5, **kw) -> str:
        """LayerNorm over the last dim, with optional weight and bias [d] (torch.nn.LayerNorm)."""
        ins = (x,) if w is None else (x, w) if b is None else (x, w, b)
        return self.kernel("layernorm", *ins, eps=float(eps), **kw)

    # ---- layers ------------------------------------------------------------------------------
    def linear(self, x: str, w: str, b: str | None = None, **kw) -> str:
        """x @ w^T [+ b], with w [out, in] as checkpoints and torch.nn.Linear store it."""
        return self.kernel("linear", *((x, w) if b is None else (x, w, b)), **kw)

    def embedding(self, ids: str, table: str, **kw) -> str:
        """Rows of table [rows, d] for integer ids [..]: [.., d]."""
        return self.kernel("embedding", ids, table, **kw)

    def sdpa(self, q: str, k: str, v: str, causal: bool = False, scale: float | None = None, **kw) -> str:
        """softmax(q k^T * scale) v on [.., t, d] tensors (F.scaled_dot_product_attention)."""
        return self.kernel("sdpa", q, k, v, causal=causal, scale=scale, **kw)

    # ---- shapes (each a copy) ----------------------------------------------------------------
    def transpose(self, x: str, **kw) -> str:
        return self.kernel("transpose", x, **kw)

    def reshape(self, x: str, shape: Sequence[int], **kw) -> str:
        return self.kernel("reshape", x, shape=[int(d) for d in shape], **kw)

    def permute(self, x: str, dims: Sequence[int], **kw) -> str:
        return self.kernel("permute", x, dims=[int(d) for d in dims], **kw)

    def concat(self, *xs: str, axis: int = -1, **kw) -> str:
        return self.kernel("concat", *xs, axis=axis, **kw)

    def slice(self, x: str, axis: int, start: int, stop: int, **kw) -> str:
        """A copy of x's indices start..stop-1 along axis."""
        return self.kernel("slice", x, axis=axis, start=start, stop=stop, **kw)

    def split(
        self, x: str, sizes: Sequence[int], axis: int = -1, ids: Sequence[str] | None = None
    ) -> list[str]:
        """x cut along axis into consecutive pieces of `sizes` (one `slice` vertex each)."""
        out, at = [], 0
        for n, size in enumerate(sizes):
            out.append(self.slice(x, axis, at, at + size, id=None if ids is None else ids[n]))
            at += size
        return out

    def cast(self, x: str, dtype: str, **kw) -> str:
        return self.kernel("cast", x, dtype=dtype, **kw)

    # ---- reductions --------------------------------------------------------------------------
    def sum(self, x: str, axes: int | Sequence[int], keepdim: bool = False, **kw) -> str:
        ax = [axes] if isinstance(axes, int) else list(axes)
        return self.kernel("sum", x, axes=ax, keepdim=keepdim, **kw)

    def mean(self, x: str, axes: int | Sequence[int], keepdim: bool = False, **kw) -> str:
        ax = [axes] if isinstance(axes, int) else list(axes)
        return self.kernel("mean", x, axes=ax, keepdim=keepdim, **kw)
