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
    return parts[0], dtypes[1]


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
        flops=no_flops,
        doc="route [rows, experts] (moe_route's) and one output [rows, dim] per expert -> the sum over "
        "the experts routed in some row of route[:, n] * out_n (rows not routed to n add nothing; an "
        "expert routed in no row is not read at all)",
    )
)
