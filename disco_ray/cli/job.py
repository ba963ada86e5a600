"""Entry point for `ray job submit`: run a TaskGraph on the cluster the job was submitted to.

    ray job submit --address http://HEAD:8265 --working-dir . \\
        --runtime-env-json '{"excludes": [".venv", ".git"]}' -- \\
        python -m disco_ray.cli.job graph.json --capacity 64MiB --placement spread --links --check-reference

Takes the options of `disco-ray run` (without --engine: always the ray engine), connects to the
job's cluster (--address defaults to auto, which inside a job is $RAY_ADDRESS), runs the graph,
and prints the run summary (placement and transfer paths included) to stdout, then one line
`disco-ray summary: {json}` for machines. --links adds `measure_links` figures to that JSON;
--check-reference compares the outputs with the reference (the graph evaluated by plain torch, or
a workload's own torch code; exit status 1 on a mismatch). --out is optional here (a job's files stay on the head node).
"""

from __future__ import annotations

import argparse
import json
import sys

from disco_ray.graph.errors import DiscoError, UsageError

PREFIX = "disco-ray summary: "


def build_parser() -> argparse.ArgumentParser:
    from .run import add_run

    root = argparse.ArgumentParser(prog="python -m disco_ray.cli.job", add_help=False)
    sub = root.add_subparsers(dest="command")
    add_run(sub)
    p = sub.choices["run"]
    p.prog = "python -m disco_ray.cli.job"
    p.description = "Run TASKGRAPH on the Ray cluster this job runs in and print its summary."
    for a in p._actions:
        if a.dest == "out":
            a.required = False
        elif a.dest == "engine":
            a.choices, a.default, a.help = ["ray"], "ray", argparse.SUPPRESS
        elif a.dest == "address":
            a.default = "auto"
    p.add_argument("--links", action="store_true", help="measure each worker pair's link after the run")
    return p


def run_job(args: argparse.Namespace) -> int:
    """Plans, runs and reports; returns the exit status."""
    import torch

    from disco_ray.driver.api import compile
    from disco_ray.driver.cluster import measure_links
    from disco_ray.driver.placement import cluster_kwargs
    from disco_ray.graph.trace import format_summary

    from .app import capacity_of, host_capacity_of
    from .npz import save_npz
    from .run import given_plan
    from .target import load_target

    if args.out and not str(args.out).endswith(".npz"):
        raise UsageError(f"--out {args.out}: the outputs are written as .npz")
    w = load_target(args)  # a TaskGraph file (and its inputs) or a workload by name
    tg, inputs = w.taskgraph, w.inputs
    kw = {"engine": "ray", "backend": args.backend, "streams": args.streams, **cluster_kwargs(args)}
    kw["disk_dir"] = args.disk
    prog = (
        given_plan(args, tg, kw)
        if args.plan
        else compile(tg, capacity_of(args, tg.gpus), host_capacity=host_capacity_of(args, tg.gpus), **kw)
    )
    status = 0
    with prog:
        outs = prog.run(
            inputs, check=args.check, trace=args.trace, delay=args.delay, seed=args.seed, timeout=args.timeout
        )
        summary = dict(prog.last_summary or {})
        if args.links:
            summary["links"] = measure_links(prog)
    if args.out:
        save_npz(args.out, outs)
    if args.check_reference:
        ref = w.reference(inputs)
        bad = [k for k in tg.outputs if not _close(outs[k], ref[k], torch)]
        summary["reference"] = "mismatch: " + ", ".join(bad) if bad else "match"
        status = 1 if bad else 0
    print(format_summary(summary))
    if "reference" in summary:
        print(f"  reference: {summary['reference']}")
    print(PREFIX + json.dumps(summary, default=str), flush=True)
    return status


def _close(a, b, torch) -> bool:
    tol = 1e-5 if b.dtype == torch.float32 else 2e-2  # as the runtime tests compare
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), tol, tol))


def main(argv: list[str] | None = None) -> int:
    try:
        return run_job(build_parser().parse_args(argv))
    except DiscoError as e:
        print(f"disco-ray job: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
