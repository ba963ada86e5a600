"""What `run` and `bench` run: a TaskGraph file of one's own with its inputs, or a built-in workload.

    disco-ray run  graph.json --inputs in.npz ...           a file (.json or .msgpack) and an .npz
    disco-ray run  llama_prefill preset=tiny ...            a workload by name, with its parameters
    disco-ray bench graph.json --inputs in.npz ...

Either way the command gets a `workloads.Workload`: for a file, `workloads.graph_workload` (its
reference is the graph evaluated by plain torch, its levels the longest-path depths); for a
name, the builder's (its own torch reference and levels). Without `--inputs`, a file's inputs are
random from `--seed`; a workload's are its own, and `--inputs` replaces them.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from disco_ray.graph import formats
from disco_ray.graph.errors import DiscoError, UsageError

log = logging.getLogger("disco_ray")


def add_target_args(p: argparse.ArgumentParser) -> None:
    """TARGET [key=value ...] --inputs --seed."""
    from .app import seed_arg

    p.add_argument(
        "target",
        metavar="TASKGRAPH|WORKLOAD",
        help="a TaskGraph file (.json or .msgpack), or a built-in workload (disco-ray workload --list)",
    )
    p.add_argument("params", nargs="*", metavar="key=value", help="workload parameters, e.g. n=8 gpus=2")
    p.add_argument(
        "--inputs",
        metavar="IN.npz",
        help="input tensors keyed by TaskGraph id (default: a workload's own; random for a file)",
    )
    p.add_argument(
        "--seed", type=seed_arg, default=0, help="seed of random inputs (and of --delay), 0..2**63-1"
    )


def add_run_target_args(p: argparse.ArgumentParser) -> None:
    """What `run` and `bench` take: TARGET [key=value ...] --inputs --seed, and the budget it runs
    under: --capacity (default: everything fits), --capacity-gpu, --host-capacity, --disk."""
    from .app import add_capacity_args, add_tier_args

    add_target_args(p)
    add_capacity_args(p, default="everything fits")
    add_tier_args(p)


def is_file(target: str) -> bool:
    """A path (it exists, or ends in .json/.msgpack) rather than a workload name."""
    return Path(target).suffix.lower() in formats.SUFFIXES or Path(target).exists()


def check_fits_memory(tg, target: str, what: str = "random inputs") -> None:
    """UsageError, naming the file and the largest input, when the caller's inputs alone would not
    fit in the memory this machine has free (an allocation failure deep in torch otherwise)."""
    from workloads import available_memory

    need = sum(v.nbytes for v in tg.caller_inputs())
    free = available_memory()
    if free is not None and need > free:
        big = max(tg.caller_inputs(), key=lambda v: v.nbytes)
        raise UsageError(
            f"{target}: its {what} need {need} bytes, more than the {free} bytes of memory free "
            f"(the largest, input {big.id!r} {list(big.shape)} {big.dtype}, {big.nbytes} bytes)"
        )


def checked(fn, *a, where: str):
    """fn(*a), with a DiscoError's message prefixed by the file it concerns."""
    try:
        return fn(*a)
    except DiscoError as e:
        raise UsageError(f"{where}: {e}") from None


def load_target(args: argparse.Namespace, materialize: bool = True):
    """The Workload `args` name (see module docstring); UsageError for a bad file, name or input.

    `materialize=False` builds a workload's graph without tensors (planning, simulation).
    """
    import workloads
    from disco_ray.graph.reference import check_inputs, random_inputs

    from .npz import load_npz
    from .workload import parse_params

    if is_file(args.target):
        if args.params:
            raise UsageError(
                f"{args.target}: a TaskGraph file takes no parameters, got {' '.join(args.params)}"
            )
        tg = formats.load_taskgraph(args.target)
        if args.inputs:
            inputs = load_npz(args.inputs, tg)
            checked(check_inputs, tg, inputs, where=args.inputs)
        elif materialize:
            check_fits_memory(tg, args.target)
            inputs = random_inputs(tg, args.seed)
            log.info("inputs: random, seed %d (--inputs IN.npz gives them)", args.seed)
        else:
            inputs = {}
        return workloads.graph_workload(Path(args.target).name, tg, inputs, {"file": args.target})
    if args.target not in workloads.REGISTRY:
        raise UsageError(
            f"unknown workload {args.target!r} (one of {', '.join(workloads.names())}), and no "
            "TaskGraph file (.json, .msgpack) of that name"
        )
    kv = parse_params(args.params)
    if not materialize and not args.inputs and "materialize" in workloads.params(args.target):
        kv.setdefault("materialize", "false")  # a simulation needs no tensors
    w = workloads.build_from_strings(args.target, kv)
    if args.inputs:
        inputs = load_npz(args.inputs, w.taskgraph)
        checked(check_inputs, w.taskgraph, inputs, where=args.inputs)
        w = type(w)(w.name, w.taskgraph, inputs, w.reference, w.levels, w.weights, w.params, w.meta)
    return w
