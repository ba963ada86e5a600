"""`disco-ray demo`: the main job. Plans a workload for a GPU memory budget far below its size,
runs it on Ray (cuda backend when a GPU is present, else cpu with logical GPUs) and checks the
outputs against a plain torch implementation.

    python -m disco_ray.cli.demo [--workload llama_prefill|matmul_chain] [--backend auto|cpu|cuda]
                             [--engine ray|local] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from .app import command
from .paths import writable_dir

# Per backend: workload parameters and the arena per GPU as a fraction of that GPU's weights.
SETTINGS: dict[tuple[str, str], tuple[dict[str, Any], float]] = {
    ("llama_prefill", "cpu"): ({"preset": "tiny", "layers": 4, "gpus": 2, "seq": 256, "tile": 64}, 0.35),
    ("llama_prefill", "cuda"): (
        {
            "layers": 2,
            "gpus": 2,
            "seq": 4096,
            "dim": 4096,
            "heads": 32,
            "ffn": 11008,
            "tile": 1024,
            "dtype": "float16",
        },
        0.35,
    ),
    ("matmul_chain", "cpu"): ({"n": 12, "gpus": 2, "tokens": 256, "hidden": 1024}, 0.35),
    ("matmul_chain", "cuda"): ({"n": 16, "gpus": 1, "tokens": 8192, "hidden": 8192, "dtype": "float16"}, 0.2),
}


@command("demo", help="plan, run and check a workload far larger than its memory budget")
def add_demo(p) -> None:
    p.add_argument("--workload", default="llama_prefill", choices=sorted({w for w, _ in SETTINGS}))
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--engine", default="ray", choices=["ray", "local"])
    p.add_argument(
        "--out",
        default="out",
        type=writable_dir("--out"),
        help="folder for the trace and the MemGraph (default: out)",
    )


def cmd_demo(args) -> int:
    import torch

    import workloads
    from disco_ray.driver.program import Program
    from disco_ray.graph.formats import save
    from disco_ray.graph.sizes import format_size
    from disco_ray.graph.trace import format_summary
    from planner import build_memgraph, min_capacity
    from planner.verify import verify

    backend = args.backend if args.backend != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    params, fraction = SETTINGS[(args.workload, backend)]

    def say(*a: object, sep: str = " ") -> None:
        print(*a, sep=sep, flush=True)

    say(f"disco-ray demo: {args.workload} {params} on the {backend} backend, {args.engine} engine")
    w = workloads.build(args.workload, **params)
    tg = w.taskgraph
    weights = [0] * tg.gpus
    for i in w.weights:
        weights[tg[i].gpu] += tg[i].nbytes
    cap = [
        max(int(b * fraction) // 256 * 256, m) for b, m in zip(weights, min_capacity(tg))
    ]  # aligned: no rounding
    say(
        f"taskgraph: {len(tg)} vertices on {tg.gpus} GPU(s); weights per GPU "
        f"{', '.join(format_size(b) for b in weights)}; arena per GPU {', '.join(format_size(c) for c in cap)}"
    )
    t = time.perf_counter()
    mg = build_memgraph(tg, cap)
    st = mg.statistics()
    say(
        f"planned in {time.perf_counter() - t:.2f} s: {st['vertices']} vertices "
        f"({st['by_kind']['offload']} offloads, {st['by_kind']['reload']} reloads), "
        f"{st['data_edges']} data + {st['mem_edges']} memory edges; offloaded {format_size(st['bytes_offloaded'])}, "
        f"reloaded {format_size(st['bytes_reloaded'])}"
    )
    bad = verify(tg, mg)
    if bad:
        say("the plan does not verify:", *bad, sep="\n  ")
        return 1
    say("plan verified: acyclic, in capacity, race-free, outputs in place")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save(mg, out / "demo.memgraph.json")
    with Program(tg, mg, engine=args.engine, backend=backend) as prog:
        prog.run(w.inputs)  # warm-up: actors start, kernels and allocator warm
        res = prog.run(w.inputs, trace=str(out / "demo.trace.json"), details=True)
        got, summary = res.outputs, res.summary
    ref = w.reference(w.inputs)
    worst = 0.0
    for k, r in ref.items():
        g = got[k].float()
        err = ((g - r.float().cpu()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item()
        worst = max(worst, err)
    tol = 2e-2 if tg[tg.outputs[0]].dtype in ("float16", "bfloat16") else 1e-4
    say(format_summary(summary))
    say(f"outputs match the plain torch reference: max relative error {worst:.1e} (tolerance {tol:g})")
    say(f"wrote {out / 'demo.trace.json'} (open in https://ui.perfetto.dev) and {out / 'demo.memgraph.json'}")
    return 0 if worst <= tol else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m disco_ray.cli.demo", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command")
    add_demo(sub)
    return cmd_demo(ap.parse_args(["demo", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())
