"""`disco-ray plan`, `verify`, `info` and `ops`: the commands on TaskGraph and MemGraph files."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from disco_ray.graph import formats
from disco_ray.graph.errors import DiscoError, UsageError
from disco_ray.graph.memgraph import DISK, MemGraph, MKind
from disco_ray.graph.sizes import format_size
from disco_ray.graph.taskgraph import TaskGraph

from .app import (
    PROG,
    add_capacity_args,
    add_tier_args,
    capacity_of,
    command,
    host_capacity_of,
    output_path,
    positive_int,
    power_of_two,
    read_order,
)

log = logging.getLogger("disco_ray")


# ---- statistics --------------------------------------------------------------------------------
def taskgraph_stats(tg: TaskGraph) -> dict:
    """TaskGraph.statistics() plus edge counts and each GPU's largest single-vertex footprint."""
    st = tg.statistics()
    st["edges"] = sum(len(set(v.inputs)) for v in tg)
    from planner import min_capacity  # the smallest capacity any plan can work with

    need = min_capacity(tg)
    st["min_capacity_per_gpu"] = need
    return st


def memgraph_stats(mg: MemGraph) -> dict:
    """MemGraph.statistics() plus bytes moved to and from the host and each arena's high-water mark.

    The byte counts are recomputed from the vertices, so they hold for MemGraphs without planner stats.
    """
    st = mg.statistics()
    st["bytes_offloaded"] = sum(v.out.nbytes for v in mg if v.kind is MKind.OFFLOAD)
    st["bytes_reloaded"] = sum(v.out.nbytes for v in mg if v.kind is MKind.RELOAD)
    st["bytes_offloaded_disk"] = sum(
        v.out.nbytes for v in mg if v.kind is MKind.OFFLOAD and v.out.device == DISK
    )
    st["bytes_reloaded_disk"] = sum(
        v.out.nbytes for v in mg if v.kind is MKind.RELOAD and v.ins and v.ins[0].loc.device == DISK
    )
    high = [0] * mg.gpus
    for v in mg:
        if 0 <= v.out.device < mg.gpus:
            high[v.out.device] = max(high[v.out.device], v.out.end)
    st["arena_high_water"] = high
    return st


def _sizes(xs: list[int]) -> str:
    return ", ".join(f"gpu:{g} {format_size(n)}" for g, n in enumerate(xs))


def _kinds(by_kind: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in by_kind.items() if n)


def summary_lines(st: dict, what: str) -> list[str]:
    """A few human-readable lines for `info` and `plan`."""
    if what == "taskgraph":
        return [
            f"taskgraph: {st['vertices']} vertices ({_kinds(st['by_kind'])}) on {st['gpus']} GPU(s), "
            f"{st['edges']} edges, {st['outputs']} output(s)",
            f"tensor bytes: {_sizes(st['tensor_bytes_per_gpu'])}; inputs {format_size(st['input_bytes'])}",
            f"min capacity (largest vertex): {_sizes(st['min_capacity_per_gpu'])}",
        ]
    lines = [
        f"memgraph: {st['vertices']} vertices ({_kinds(st['by_kind'])}), {st['edges']} edges "
        f"({st['data_edges']} data, {st['mem_edges']} mem)",
        f"offloaded {format_size(st['bytes_offloaded'])} in {st['by_kind']['offload']} offloads, "
        f"reloaded {format_size(st['bytes_reloaded'])} in {st['by_kind']['reload']} reloads",
        f"capacity: {_sizes(st['capacity'])}",
        f"arena high-water: {_sizes(st['arena_high_water'])}",
    ]
    for key, label in (
        ("peak_gpu_bytes", "peak live GPU bytes"),
        ("peak_host_bytes", "peak host store bytes"),
    ):
        if isinstance(st.get(key), list):
            lines.append(f"{label}: {_sizes(st[key])}")
    if any(st.get("disk_capacity") or ()) or st.get("bytes_offloaded_disk"):
        host, disk = st["bytes_offloaded"] - st["bytes_offloaded_disk"], st["bytes_offloaded_disk"]
        lines.append(
            f"tiers: host offloaded {format_size(host)}, reloaded "
            f"{format_size(st['bytes_reloaded'] - st['bytes_reloaded_disk'])}; disk offloaded "
            f"{format_size(disk)}, reloaded {format_size(st['bytes_reloaded_disk'])}"
        )
        if isinstance(st.get("peak_disk_bytes"), list):
            lines.append(f"peak spill file bytes: {_sizes(st['peak_disk_bytes'])}")
        lines.append(f"spill file size: {_sizes(st['disk_capacity'])}")
    budget = st.get("host_budget")
    if isinstance(budget, list) and any(b is not None for b in budget):
        lines.append(
            "host budget: "
            + ", ".join(
                f"gpu:{g} {'unbounded' if b is None else format_size(b)}" for g, b in enumerate(budget)
            )
        )
    known = {"vertices", "by_kind", "edges", "data_edges", "mem_edges", "capacity", "host_capacity"}
    known |= {"bytes_offloaded", "bytes_reloaded", "arena_high_water", "peak_gpu_bytes", "peak_host_bytes"}
    known |= {
        "disk_capacity",
        "bytes_offloaded_disk",
        "bytes_reloaded_disk",
        "peak_disk_bytes",
        "host_budget",
    }
    extra = {k: v for k, v in st.items() if k not in known and isinstance(v, (int, float, str))}
    if extra:
        lines.append("planner: " + ", ".join(f"{k} {v}" for k, v in extra.items()))
    return lines


# ---- plan --------------------------------------------------------------------------------------
@command(
    "plan",
    help="build a MemGraph from a TaskGraph (BUILDMEMGRAPH)",
    description="Plan TASKGRAPH for GPUs of the given capacity and write the MemGraph.",
)
def add_plan(p) -> None:
    p.add_argument("taskgraph", metavar="TASKGRAPH", help="TaskGraph file (.json or .msgpack)")
    add_capacity_args(p, required=True, measured=False)
    add_tier_args(p, disk=False)
    p.add_argument(
        "--order",
        metavar="FILE",
        help="vertex order to plan in: JSON list of ids, or one id per line (default: the planner's)",
    )
    p.add_argument(
        "--alignment",
        type=power_of_two,
        default=256,
        metavar="BYTES",
        help="arena offset alignment (default 256)",
    )
    p.add_argument(
        "-o",
        "--output",
        type=output_path,
        required=True,
        metavar="MEMGRAPH",
        help="where to write the MemGraph (.json or .msgpack)",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="processes that simulate the GPUs in parallel (default: every usable CPU for a large graph)",
    )


def cmd_plan(args) -> int:
    if Path(args.output).resolve() == Path(args.taskgraph).resolve():
        raise UsageError(f"{args.output}: -o names the TaskGraph file itself (it would be overwritten)")
    tg = formats.load_taskgraph(args.taskgraph)
    caps = capacity_of(args, tg.gpus, measured=False)
    assert caps is not None and not isinstance(caps, str)  # `plan` requires a size (add_capacity_args)
    order = read_order(args.order) if args.order else None
    from planner import build_memgraph

    try:
        mg = build_memgraph(
            tg,
            caps,
            order=order,
            alignment=args.alignment,
            host_capacity=host_capacity_of(args, tg.gpus),
            workers=args.workers,
        )
    except DiscoError as e:
        raise type(e)(f"{args.taskgraph}: {e}") from None
    try:
        formats.save(mg, args.output)
    except OSError as e:  # name the file asked for, not the temporary one beside it
        raise UsageError(f"{args.output}: cannot write ({e.strerror})") from None
    for line in summary_lines(memgraph_stats(mg), "memgraph"):
        log.info(line)
    log.info("wrote %s", args.output)
    return 0


# ---- verify ------------------------------------------------------------------------------------
@command(
    "verify",
    help="check that a MemGraph is a correct plan of a TaskGraph",
    description="Exit 0 if MEMGRAPH is correct for TASKGRAPH (FORMATS.md), else print "
    "one violation per line and exit 1.",
)
def add_verify(p) -> None:
    p.add_argument("taskgraph", metavar="TASKGRAPH")
    p.add_argument("memgraph", metavar="MEMGRAPH")
    p.add_argument("--limit", type=positive_int, default=20, help="report at most this many violations")


def cmd_verify(args) -> int:
    tg = formats.load_taskgraph(args.taskgraph)
    mg = formats.load_memgraph(args.memgraph)
    from planner.verify import verify

    violations = verify(tg, mg, limit=args.limit)
    for v in violations:
        print(v)
    if violations:
        print(f"{PROG}: {args.memgraph}: {len(violations)} violation(s)", file=sys.stderr)
        return 1
    print(f"ok: {args.memgraph} is a correct plan of {args.taskgraph} ({len(mg)} vertices)")
    return 0


# ---- info --------------------------------------------------------------------------------------
@command(
    "info",
    help="statistics of a TaskGraph or MemGraph file",
    description="Print vertices by kind, edges, bytes offloaded/reloaded, peak bytes.",
)
def add_info(p) -> None:
    p.add_argument("file", metavar="FILE", help="a TaskGraph or MemGraph (.json or .msgpack)")
    p.add_argument("--json", action="store_true", help="print the statistics as one JSON object")


def cmd_info(args) -> int:
    g = formats.load_any(args.file)
    what = "memgraph" if isinstance(g, MemGraph) else "taskgraph"
    st = memgraph_stats(g) if isinstance(g, MemGraph) else taskgraph_stats(g)
    if args.json:
        print(json.dumps({"format": f"disco-{what}", **st}))
    else:
        print("\n".join(summary_lines(st, what)))
    return 0


# ---- ops ---------------------------------------------------------------------------------------
@command("ops", help="list the op set", description="Print the op table (docs/OPS.md).")
def add_ops(p) -> None:
    p.add_argument("--markdown", action="store_true", help="print docs/OPS.md")


def ops_markdown() -> str:
    """docs/OPS.md: the registered ops with FORMATS.md's columns, plus attrs and FLOPs."""
    from disco_ray.graph import ops

    rows = [
        "# Op set",
        "",
        "Generated by `python -m disco_ray ops --markdown > docs/OPS.md` from the op registry",
        "(`disco_ray/graph/ops.py`, `ops_llm.py`, `ops_nn.py`, `ops_train.py`, `ops_sample.py`,",
        "`ops_act.py`, `ops_headnorm.py`); the columns are those of",
        "[FORMATS.md](FORMATS.md). Every op also runs on the CPU. An op of one's own is registered as",
        "[README](../README.md#your-own-op) shows; [FRONTEND.md](FRONTEND.md) lists the ATen ops that",
        "`disco_ray.from_torch` maps onto these.",
        "",
        "| op | operands | result | attrs |",
        "| --- | --- | --- | --- |",
    ]
    for name in sorted(ops.OPS):
        spec = ops.OPS[name]
        hi = "n" if spec.max_arity is None else spec.max_arity
        n = f"{spec.min_arity}" if hi == spec.min_arity else f"{spec.min_arity}..{hi}"
        attrs = ", ".join(
            f"`{k}`" + (" (required)" if d is ops.REQUIRED else f" = {d!r}") for k, d in spec.attrs.items()
        )
        doc = spec.doc.replace("|", "\\|")
        rows.append(f"| `{name}` | {n} | {doc} | {attrs or '-'} |")
    return "\n".join(rows) + "\n"


def cmd_ops(args) -> int:
    from disco_ray.graph import ops

    if args.markdown:
        print(ops_markdown(), end="")
    else:
        for name in sorted(ops.OPS):
            print(f"{name:12} {ops.OPS[name].doc}")
    return 0
