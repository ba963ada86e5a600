"""Batched generation with the KV cache in float32 against int8 (issue 26 item 3), on this CPU.

    .venv/bin/python benchmarks/bench_kv.py [--dir /tmp/bench_llama] [--prompt 128] [--new 32]
        [--batches 16,64] [--rounds 2] [--weights host] [--micro auto] [--json out.json]

On the 0.49 GB benchmark checkpoint (benchmarks/bench_llama_cpu.py makes it once: 8 layers, 4
key/value heads of 64), `batch` prompts of --prompt random tokens, --new new tokens each (greedy,
no stop), local engine, an arena of a third of the float32 weights, so the cache is offloaded
(every decode step loads each row's cache blocks from the host store, and the weights that do
not stay), micro-batches the plans' choice (`--micro auto`) or fixed. Two models are open at
once, one per cache kind, and the runs interleave (per round, per batch: float32, then int8) so
that both see the same minutes of this shared machine.

Per run: new tokens/s over the whole call (prefill included), the median decode step, the bytes
a decode step loads (inputs and reloads, `BatchGeneration.bytes_loaded`, median over the steps)
and, of them, the KV cache's (the last decode step's plan: its cache state inputs and their
reloads), and whether int8's greedy tokens are float32's. A benchmark: it measures and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_batch import prompts  # noqa: E402
from bench_llama_cpu import checkpoint  # noqa: E402

from disco_ray.graph.memgraph import MKind  # noqa: E402
from workloads.llm.checkpoint import Checkpoint  # noqa: E402

KINDS = ("float", "int8")


def cache_bytes(model, rows: int) -> int:
    """Bytes of KV cache that the last decode step's plan of `rows` rows loads and reloads."""
    key = max((k for k in model._programs if k[0] == "batch_decode" and k[1] == rows), key=lambda k: k[2])
    mgraph, prog = model._programs[key]
    tg = mgraph.taskgraph
    states = {v.id for v in tg if v.state}
    kinds = (MKind.INPUT, MKind.RELOAD)
    return sum(v.out.nbytes for v in prog.mg.vertices if v.kind in kinds and v.value in states)


def run(model, batch: list[list[int]], new: int, micro: int | str) -> dict:
    t = time.perf_counter()
    out = model.run_generate_batch(batch, new, stop_at_eos=False, micro=micro)
    wall = time.perf_counter() - t
    st = out.statistics()
    return {
        "wall_s": wall,
        "tokens_per_s": st["new_tokens"] / wall,
        "prefill_s": st["prefill_s"],
        "step_ms": st["step_ms"]["median"],
        "loaded_per_step": statistics.median(out.bytes_loaded),
        "kv_loaded_per_step": cache_bytes(model, out.rows[-1]),
        "micro": sorted(set(out.micros)),
        "tokens": [list(s.new_ids) for s in out.sequences],
    }


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    from disco_ray.models import LlamaModel

    path = checkpoint(Path(args.dir))
    weights = Checkpoint(path).weight_bytes()
    third = weights // 3
    batches = [int(b) for b in args.batches.split(",")]
    micro = args.micro if args.micro == "auto" else int(args.micro)
    print(
        f"checkpoint {path}: {weights / 1e9:.2f} GB float32; prompt {args.prompt}, {args.new} new tokens; "
        f"arena {third / 1e6:.0f} MB (a third of the weights), weights={args.weights}, micro {micro}; "
        f"{torch.get_num_threads()} torch threads; load average {os.getloadavg()[0]:.1f} at start"
    )
    kw = dict(capacity=third, engine="local", weights=args.weights)
    models = {kv: LlamaModel(str(path), kv_cache=kv, **kw) for kv in KINDS}
    rows: dict = {}
    try:
        for b in batches:  # warm-up: each shape's plans, the weights read
            for kv in KINDS:
                models[kv].run_generate_batch(
                    prompts(b, args.prompt), args.new, stop_at_eos=False, micro=micro
                )
        for rnd in range(args.rounds):
            for b in batches:
                for kv in KINDS:
                    r = run(models[kv], prompts(b, args.prompt), args.new, micro)
                    r["load_average"] = os.getloadavg()[0]
                    rows.setdefault((b, kv), []).append(r)
                    print(
                        f"  round {rnd} batch {b:>3} {kv:>5}: {r['tokens_per_s']:7.1f} new tokens/s, step "
                        f"{r['step_ms']:6.0f} ms, {r['loaded_per_step'] / 1e6:6.0f} MB loaded per step "
                        f"({r['kv_loaded_per_step'] / 1e6:.0f} MB of cache), micro {r['micro']}, "
                        f"load {r['load_average']:.1f}",
                        flush=True,
                    )
    finally:
        for m in models.values():
            m.close()
    print(_table(rows, batches))
    if args.json:
        doc = {
            f"{b}/{kv}": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
            for (b, kv), rs in rows.items()
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


def _table(rows: dict, batches: list[int]) -> str:
    """The markdown table: per batch and cache kind, the best round's figures."""
    out = [
        "| batch | KV cache | new tokens/s (best) | decode step ms | MB loaded per step | of which KV cache | tokens |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in batches:
        for kv in KINDS:
            best = max(rows[b, kv], key=lambda r: r["tokens_per_s"])
            same = all(r["tokens"] == rows[b, "float"][0]["tokens"] for r in rows[b, kv])
            agree = _agreement(rows[b, kv][0]["tokens"], rows[b, "float"][0]["tokens"])
            out.append(
                f"| {b} | {kv} | {best['tokens_per_s']:.1f} | {best['step_ms']:.0f} | "
                f"{best['loaded_per_step'] / 1e6:.0f} | {best['kv_loaded_per_step'] / 1e6:.1f} | "
                f"{'float32' if same else f'{100 * agree:.0f}% of float32'}'s |"
            )
    return "\n".join(out)


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of new tokens equal at the same place."""
    pairs = [(x, y) for s, t in zip(a, b) for x, y in zip(s, t)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/bench_llama", help="where the checkpoint is (made if missing)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (float32, int8) per batch")
    ap.add_argument("--weights", choices=["host", "disk"], default="host")
    ap.add_argument("--micro", default="auto", help="micro-batches per step (auto: the plans' choice)")
    ap.add_argument("--json", help="write the figures here too")
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
