"""An op of one's own, registered as README's "Your own op" says: the spec (arity, attributes,
shape inference) with `ops.register`, the kernel with `kernels.impl`; then built, planned with
offloads and run like any op. Without a kernel, or unknown, it is refused with the fix named."""

from __future__ import annotations

import pytest
import torch

import disco_ray
from disco_ray.graph import kernels, ops
from disco_ray.graph.errors import GraphError, UsageError
from disco_ray.graph.taskgraph import TaskGraph


def register_clamp_scale() -> None:
    """The README's example op: min(max(x, lo), hi) * factor (attributes lo, hi; factor required)."""

    def infer(shapes, dtypes, attrs):
        if attrs["lo"] > attrs["hi"]:
            raise ValueError(f"clamp_scale: lo {attrs['lo']} > hi {attrs['hi']}")
        return shapes[0], dtypes[0]

    ops.register(
        ops.OpSpec(
            "clamp_scale",
            1,
            1,
            infer,
            attrs={"lo": -1.0, "hi": 1.0, "factor": ops.REQUIRED},
            flops=lambda shapes, out, attrs: 2.0 * ops.numel(out),
            doc="min(max(x, lo), hi) * factor",
        )
    )

    @kernels.impl("clamp_scale")
    def _clamp_scale(out, ins, attrs):
        torch.clamp(ins[0], attrs["lo"], attrs["hi"], out=out)
        out.mul_(attrs["factor"])


@pytest.fixture
def clamp_scale():
    register_clamp_scale()
    yield
    kernels.unregister("clamp_scale")


def chain(n: int = 4) -> TaskGraph:
    """x -> (matmul w_i, clamp_scale) n times, plus x: every tensor 16 KiB, x alive to the end."""
    g = TaskGraph()
    x = y = g.input("x", (64, 64))
    for i in range(n):
        y = g.kernel("clamp_scale", g.matmul(y, g.input(f"w{i}", (64, 64))), factor=0.5, lo=-2.0)
    g.output(g.add(y, x))
    return g


def want(inputs: dict, n: int = 4) -> torch.Tensor:
    y = inputs["x"]
    for i in range(n):
        y = torch.clamp(y @ inputs[f"w{i}"], -2.0, 1.0) * 0.5
    return y + inputs["x"]


def test_an_own_op_plans_with_offloads_and_runs(clamp_scale):
    g = chain()
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(64, 64, generator=gen) for k in ["x", "w0", "w1", "w2", "w3"]}
    res = disco_ray.run(g, inputs, capacity="48KiB", engine="local", details=True)
    assert res.plan.stats["bytes_reloaded"] > 0  # a matmul takes 48 KiB while x waits: x is evicted
    torch.testing.assert_close(res.outputs[g.outputs[0]], want(inputs))


def test_its_attributes_are_checked_like_a_built_in_ops(clamp_scale):
    g = TaskGraph()
    x = g.input("x", (4,))
    with pytest.raises(GraphError, match="op clamp_scale needs attribute 'factor'"):
        g.kernel("clamp_scale", x)
    with pytest.raises(GraphError, match=r"clamp_scale: lo 3\.0 > hi 1\.0"):
        g.kernel("clamp_scale", x, factor=1.0, lo=3.0)


def test_an_op_without_a_kernel_is_refused_before_anything_runs():
    ops.register(ops.OpSpec("no_kernel", 1, 1, lambda s, d, a: (s[0], d[0])))
    try:
        g = TaskGraph()
        g.output(g.kernel("no_kernel", g.input("x", (4,))))
        with pytest.raises(
            UsageError,
            match=r"op 'no_kernel' has no kernel: define one with @disco_ray.graph.kernels.impl\('no_kernel'\)",
        ):
            disco_ray.run(g, {"x": torch.ones(4)}, engine="local")
    finally:
        kernels.unregister("no_kernel")


def test_an_unknown_op_names_where_to_register_it():
    g = TaskGraph()
    with pytest.raises(
        GraphError, match=r"unknown op 'clamp_scale' .*registered before the graph is built or loaded"
    ):
        g.kernel("clamp_scale", g.input("x", (4,)), factor=1.0)


def test_own_ops_are_those_registered_after_the_built_in_set(clamp_scale):
    assert list(kernels.own_ops(["matmul", "clamp_scale", "gelu"])) == ["clamp_scale"]
    assert "clamp_scale" not in kernels.BUILTIN and "gelu" in kernels.BUILTIN
