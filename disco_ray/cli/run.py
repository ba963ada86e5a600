"""`disco-ray run`: plan a TaskGraph (or take a given MemGraph) and run it on the ray or local engine.

    disco-ray run TASKGRAPH --inputs IN.npz --capacity 64MiB --out OUT.npz
        [--plan MEMGRAPH] [--engine ray|local] [--backend cpu|cuda] [--streams 5] [--ahead N] [--check]
        [--trace trace.json] [--seed 0] [--delay LO,HI] [--timeout S]

Inputs and outputs are .npz files keyed by TaskGraph ids. Without --inputs, random inputs are
made from --seed (disco_ray.graph.reference.random_inputs). numpy has no bfloat16: a bfloat16 tensor X
is stored as the uint16 array X holding its raw bits plus a string entry "X.__dtype__" =
"bfloat16"; when reading inputs, a float32/float64 array is also accepted for a bfloat16 input
(rounded to bfloat16). A progress bar is drawn when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from disco_ray.driver.placement import add_cluster_args, cluster_kwargs
from disco_ray.graph.errors import UsageError
from disco_ray.graph.sizes import parse_capacity

DTYPE_SUFFIX = ".__dtype__"


def capacity_arg(text: str) -> int | list[int]:
    """One size for every GPU, or a comma-separated size per GPU."""
    try:
        return parse_capacity(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_capacity_arg(p: argparse.ArgumentParser) -> None:
    """`--capacity SIZE[,SIZE...]` of run and bench."""
    p.add_argument(
        "--capacity",
        type=capacity_arg,
        metavar="SIZE[,SIZE...]",
        help="arena bytes per GPU, e.g. 64MiB (default: everything fits)",
    )


def delay_arg(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad delay {text!r} (want LO,HI in seconds, e.g. 0,0.002)"
        ) from None
    if not 0 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"bad delay {text!r}: want 0 <= LO <= HI")
    return lo, hi


def add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run a TaskGraph (plan, execute, write outputs)",
        description="Plan TASKGRAPH for GPUs of --capacity bytes (or use --plan) and run it; "
        "write the outputs, keyed by TaskGraph id, to --out.",
    )
    p.add_argument("taskgraph", metavar="TASKGRAPH", help="TaskGraph file (.json or .msgpack)")
    p.add_argument("--inputs", metavar="IN.npz", help="input tensors keyed by TaskGraph id (default: random)")
    add_capacity_arg(p)
    p.add_argument("--plan", metavar="MEMGRAPH", help="run this MemGraph instead of planning")
    p.add_argument("--out", required=True, metavar="OUT.npz", help="where to write the outputs")
    add_engine_args(p)
    p.add_argument("--check", action="store_true", help="run the sanitizer (slower)")
    p.add_argument("--trace", metavar="TRACE.json", help="write a Chrome/Perfetto trace of the run")
    p.add_argument("--seed", type=int, default=0, help="seed of random inputs and of --delay")
    p.add_argument(
        "--delay", type=delay_arg, metavar="LO,HI", help="debug: sleep uniform(LO, HI) s before each vertex"
    )
    p.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds")
    add_cluster_args(p)  # --address, --placement, --gpus-per-worker, --cpus-per-worker
    p.set_defaults(func=cmd_run)


def load_npz(path: str, tg=None) -> dict:
    """Tensors of an .npz file (bfloat16 as described in the module docstring)."""
    import numpy as np
    import torch

    try:
        with np.load(path, allow_pickle=False) as z:
            raw = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read as .npz ({e})") from None
    out = {}
    for k, a in raw.items():
        if k.endswith(DTYPE_SUFFIX):
            continue
        tag = raw.get(k + DTYPE_SUFFIX)
        if tag is not None and str(tag) == "bfloat16":
            t = torch.from_numpy(a.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(a))
            if tg is not None and k in tg and tg[k].dtype == "bfloat16" and a.dtype.kind == "f":
                t = t.to(torch.bfloat16)
        out[k] = t
    return out


def save_npz(path: str, tensors: Mapping) -> None:
    """Writes tensors to .npz atomically; bfloat16 as uint16 bits + a dtype entry."""
    import numpy as np
    import torch

    arrays = {}
    for k, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            arrays[k] = t.view(torch.int16).numpy().view(np.uint16)
            arrays[k + DTYPE_SUFFIX] = np.array("bfloat16")
        else:
            arrays[k] = t.numpy()
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent if str(p.parent) else ".", prefix=f".{p.name}.", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--engine, --backend, --streams, --ahead (for `disco-ray run` and bench)."""
    p.add_argument("--engine", choices=["ray", "local"], default="ray")
    p.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--streams", type=int, default=5, help="streams per GPU (default 5)")
    p.add_argument(
        "--ahead",
        type=int,
        metavar="N",
        help="kernels a stream may hold, launched, behind the one it runs (0: launch when ready; "
        "default: 4 on cuda, 0 on cpu)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Program keyword arguments from the options of `add_engine_args`, checked."""
    if args.streams < 1:
        raise UsageError(f"--streams must be >= 1, got {args.streams}")
    if args.ahead is not None and args.ahead < 0:
        raise UsageError(f"--ahead must be >= 0, got {args.ahead}")
    return {"engine": args.engine, "backend": args.backend, "streams": args.streams, "ahead": args.ahead}


def cmd_run(args) -> int:
    from disco_ray.driver.program import Program, compile
    from disco_ray.graph import formats
    from disco_ray.graph.reference import check_inputs, random_inputs
    from disco_ray.graph.trace import format_summary

    if not str(args.out).endswith(".npz"):
        raise UsageError(f"--out {args.out}: the outputs are written as .npz")
    kw = engine_kwargs(args)
    tg = formats.load_taskgraph(args.taskgraph)
    inputs = load_npz(args.inputs, tg) if args.inputs else random_inputs(tg, args.seed)
    check_inputs(tg, inputs)  # refused before anything is planned or started
    if args.engine == "ray":
        kw.update(cluster_kwargs(args))
    if args.plan:
        prog = Program(tg, formats.load_memgraph(args.plan), **kw)
    else:
        prog = compile(tg, args.capacity, **kw)
    with prog:
        outs = prog.run(
            inputs,
            check=args.check,
            trace=args.trace,
            delay=args.delay,
            seed=args.seed,
            timeout=args.timeout,
            progress=sys.stderr.isatty(),
        )
    save_npz(args.out, outs)
    if prog.last_summary is not None:
        print(format_summary(prog.last_summary), file=sys.stderr)
    print(f"wrote {args.out}" + (f" and {args.trace}" if args.trace else ""), file=sys.stderr)
    return 0
