"""`disco-ray workload`: write a registered workload as a TaskGraph file and its inputs as .npz.

    disco-ray workload NAME [key=value ...] -o graph.json --inputs in.npz
    disco-ray workload --list

The TaskGraph is written as JSON or msgpack (by suffix); the inputs follow the .npz conventions of
`disco-ray run` (bfloat16 as raw uint16 bits plus a "X.__dtype__" entry), so that
`disco-ray run graph.json --inputs in.npz` runs exactly the workload. Both files are written
atomically, and the inputs file is removed again when the graph cannot be written.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from disco_ray.graph.errors import UsageError

from .app import command


@command(
    "workload",
    help="write a built-in workload (TaskGraph + inputs)",
    description="Build workload NAME with key=value parameters; write its TaskGraph and inputs.",
)
def add_workload(p) -> None:
    from .app import output_path, writable_file

    p.add_argument("name", nargs="?", metavar="NAME", help="workload name (see --list)")
    p.add_argument("params", nargs="*", metavar="key=value", help="builder parameters, e.g. n=8 gpus=2")
    p.add_argument("--list", action="store_true", help="list the workloads and their parameters")
    p.add_argument(
        "-o", "--output", type=output_path, metavar="GRAPH", help="TaskGraph file to write (.json/.msgpack)"
    )
    p.add_argument(
        "--inputs",
        type=writable_file("--inputs"),
        metavar="IN.npz",
        help="where to write the input tensors (.npz)",
    )


def parse_params(items: list[str]) -> dict[str, str]:
    """`["n=8", "gpus=2"]` -> {"n": "8", "gpus": "2"}; UsageError for a malformed item."""
    out: dict[str, str] = {}
    for it in items:
        k, eq, v = it.partition("=")
        if not eq or not k.strip():
            raise UsageError(f"bad workload parameter {it!r} (want key=value, e.g. n=8)")
        if k.strip() in out:
            raise UsageError(f"workload parameter {k.strip()!r} given twice")
        out[k.strip()] = v.strip()
    return out


def list_lines() -> list[str]:
    """One line per workload: its name and `param=default` for each parameter."""
    import workloads

    lines = []
    for name in workloads.names():
        try:
            ps = workloads.params(name)
        except UsageError as e:
            lines.append(f"{name}: unavailable ({e})")
            continue
        parts = [
            f"{k}:{t.__name__}" + ("" if d is inspect.Parameter.empty else f"={d}")
            for k, (t, d) in ps.items()
        ]
        doc = (inspect.getdoc(workloads.builder(name)) or "").splitlines()
        lines.append(f"{name}  {' '.join(parts)}")
        if doc:
            lines.append(f"    {doc[0]}")
    return lines


def cmd_workload(args) -> int:
    if args.list:
        print("\n".join(list_lines()))
        return 0
    if not args.name:
        raise UsageError("workload: give a NAME (or --list)")
    if args.output is None or not args.inputs:
        raise UsageError("workload: both -o GRAPH and --inputs IN.npz are required")
    if not str(args.inputs).endswith(".npz"):
        raise UsageError(f"--inputs {args.inputs}: the inputs are written as .npz")
    import workloads
    from disco_ray.graph import formats

    from .npz import save_npz

    kv = parse_params(args.params)
    if kv.get("materialize", "true").lower() in ("0", "false", "no"):
        raise UsageError("workload: materialize=false makes no inputs to write")
    w = workloads.build_from_strings(args.name, kv)
    inputs = Path(args.inputs)
    try:
        save_npz(str(inputs), w.inputs)
    except OSError as e:
        raise UsageError(f"{inputs}: cannot write ({e.strerror})") from None
    try:
        formats.save(w.taskgraph, args.output)
    except OSError as e:
        inputs.unlink(missing_ok=True)  # nothing half-written: the pair or neither
        raise UsageError(f"{args.output}: cannot write ({e.strerror})") from None
    except BaseException:
        inputs.unlink(missing_ok=True)
        raise
    st = w.statistics()
    print(
        f"{w.name}: {len(w.taskgraph)} vertices on {w.taskgraph.gpus} GPU(s), {len(w.inputs)} inputs, "
        f"{len(w.levels)} levels, {st['weight_bytes']} weight bytes",
        file=sys.stderr,
    )
    print(f"wrote {args.output} and {inputs}", file=sys.stderr)
    return 0
