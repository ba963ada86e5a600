"""The mixture-of-experts ops (Mixtral's sparse MLP block): the router's choice and the sum of
the chosen experts' outputs. Kernels live in `kernels_moe`.

A layer's router gives `moe_route`: per token row, the top-k experts' renormalised softmax
weights, zero for every other expert. The same tensor says which experts a step runs (an expert
with no non-zero weight in any row is not routed: its vertices are skipped at run time,
docs/FORMATS.md "Conditional vertices"), and `moe_combine` sums only the routed experts' outputs,
so the output of a skipped expert (never written) is never read as a number.
"""

from __future__ import annotations

from .opspec import REQUIRED, OpSpec, no_flops, numel, register

ROUTE_DTYPE = "float32"  # transformers' Mixtral routes in float32 whatever the model's dtype


def _infer_route(shapes, dtypes, attrs):
    (x,) = shapes
    k = attrs["top_k"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"moe_route: attribute top_k must be an integer >= 1, got {k!r}")
    if len(x) != 2 or not 1 <= k <= x[1]:
        raise ValueError(
            f"moe_route needs router logits [rows, experts] with top_k <= experts, got {list(x)}"
        )
    if dtypes[0] not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"moe_route: the logits must be floating point, got {dtypes[0]}")
    return x, ROUTE_DTYPE


def _infer_combine(shapes, dtypes, attrs):
    route, parts = shapes[0], shapes[1:]
    if len(route) != 2 or dtypes[0] != ROUTE_DTYPE:
        raise ValueError(f"moe_combine: the route must be {ROUTE_DTYPE} [rows, experts], got {list(route)}")
    if len(parts) != route[1]:
        raise ValueError(f"moe_combine: {len(parts)} expert outputs for a route of {route[1]} experts")
    if any(p != parts[0] or len(p) != 2 or p[0] != route[0] for p in parts):
        raise ValueError(
            f"moe_combine: the expert outputs must all be [{route[0]}, dim], got {[list(p) for p in parts]}"
        )
    if len(set(dtypes[1:])) != 1:
        raise ValueError(f"moe_combine: the expert outputs differ in dtype ({sorted(set(dtypes[1:]))})")
    if not isinstance(attrs.get("weighted", True), bool):
        raise ValueError(f"moe_combine: attribute weighted must be true or false, got {attrs['weighted']!r}")
    return parts[0], dtypes[1]


def _infer_route_grad(shapes, dtypes, attrs):
    logits, droute = shapes
    if len(logits) != 2 or droute != logits or dtypes[1] != ROUTE_DTYPE:
        raise ValueError(
            f"moe_route_grad needs logits [rows, experts] and a {ROUTE_DTYPE} route gradient of that shape, "
            f"got {[list(s) for s in shapes]}"
        )
    _infer_route([logits], dtypes[:1], attrs)
    return logits, dtypes[0]


def _infer_route_dot(shapes, dtypes, attrs):
    dy, route, parts = shapes[0], shapes[1], shapes[2:]
    _infer_combine([route, *parts], [dtypes[1], *dtypes[2:]], {})
    if dy != parts[0]:
        raise ValueError(f"moe_route_dot: dy {list(dy)} does not match the expert outputs {list(parts[0])}")
    return route, ROUTE_DTYPE


def _infer_scale_by(shapes, dtypes, attrs):
    dy, route = shapes
    n = attrs["index"]
    if isinstance(n, bool) or not isinstance(n, int) or len(route) != 2 or not 0 <= n < route[1]:
        raise ValueError(f"moe_scale: index {n!r} out of the route {list(route)}")
    if len(dy) != 2 or dy[0] != route[0] or dtypes[1] != ROUTE_DTYPE:
        raise ValueError(
            f"moe_scale needs dy [rows, dim] and a route [rows, experts], got {[list(s) for s in shapes]}"
        )
    return dy, dtypes[0]


register(
    OpSpec(
        "moe_route",
        1,
        1,
        _infer_route,
        attrs={"top_k": REQUIRED},
        flops=lambda s, o, a: 5.0 * numel(o),
        doc="router logits [rows, experts] -> per row the softmax (float32) of its top_k experts, "
        "renormalised to sum to 1, and 0 for the other experts ([rows, experts], float32)",
    )
)
register(
    OpSpec(
        "moe_combine",
        2,
        None,
        _infer_combine,
        attrs={"weighted": True},
        flops=no_flops,
        doc="route [rows, experts] (moe_route's) and one output [rows, dim] per expert -> the sum over "
        "the experts routed in some row of route[:, n] * out_n (rows not routed to n add nothing; an "
        "expert routed in no row is not read at all); weighted false: the plain sum of the routed ones' "
        "outputs (the backward's input gradient over the experts)",
    )
)
register(
    OpSpec(
        "moe_route_grad",
        2,
        2,
        _infer_route_grad,
        attrs={"top_k": REQUIRED},
        flops=lambda s, o, a: 8.0 * numel(o),
        doc="the backward of moe_route: router logits [rows, experts] and the gradient of the route "
        "(float32) -> the gradient of the logits (through the renormalised top_k softmax)",
    )
)
register(
    OpSpec(
        "moe_route_dot",
        3,
        None,
        _infer_route_dot,
        flops=lambda s, o, a: 2.0 * numel(s[0]) * s[1][1],
        doc="dy [rows, dim], route [rows, experts] and one output [rows, dim] per expert -> per row and "
        "routed expert n the dot product dy . out_n (float32; 0 for experts routed in no row): the "
        "gradient of the route",
    )
)
register(
    OpSpec(
        "moe_scale",
        2,
        2,
        _infer_scale_by,
        attrs={"index": REQUIRED},
        flops=lambda s, o, a: 1.0 * numel(o),
        doc="dy [rows, dim] times route[:, index] per row (float32 product, cast to dy's dtype): the "
        "gradient of expert index's output",
    )
)
