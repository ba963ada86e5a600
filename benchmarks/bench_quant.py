"""Decoding with quantized weights read from disk: float32 against int8 and int4, on this CPU.

    .venv/bin/python benchmarks/bench_quant.py [--dir /tmp/bench_llama] [--prompt 32] [--new 8]
        [--batches 1,16] [--modes float32,int8,int4] [--rounds 1] [--group 64] [--engine local]
        [--json out.json]

The 0.49 GB checkpoint of bench_llama_cpu.py (made once if missing), `weights="disk"` (each load
reads the weights from a file: the checkpoint for float32, the worker's packed file for int8 and
int4), an arena of a quarter of the float32 weights (or the least any plan needs, if more), and
per batch size and mode: greedy decoding of --new tokens after a --prompt-token prompt, after a
warm-up run (plans, packing). Prints new tokens/s of the decode steps (the first token comes from
the prefill and is not counted), the median step, the bytes loaded per step and the speed-up
against float32, and whether the tokens are float32's. --rounds N runs the modes N times in turn
(float32, int8, int4, float32, ...), each speed-up against its own round's float32: on a shared
machine, interleaved runs see the same load. A benchmark: nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_llama_cpu import SHAPE, checkpoint  # noqa: E402


def prompts(n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, SHAPE["vocab_size"], (length,), generator=gen).tolist() for _ in range(n)]


def run(path: str, mode: str, batch: int, args, capacity: int) -> dict:
    from disco_ray.models import LlamaModel

    quantize = None if mode == "float32" else mode
    ps = prompts(batch, args.prompt)
    with LlamaModel(
        path, capacity=capacity, engine=args.engine, weights="disk", quantize=quantize, quant_group=args.group
    ) as m:
        m.run_generate_batch(ps, 2, stop_at_eos=False)  # warm-up: plans, the packed files
        g = m.run_generate_batch(ps, args.new, stop_at_eos=False)
        st = g.statistics()
    decoded = st["new_tokens"] - st["sequences"]
    per_step = sorted(st["bytes_loaded_per_step"])
    return {
        "decode_tokens_per_s": decoded / st["decode_s"],
        "step_ms": st["step_ms"]["median"],
        "bytes_loaded_per_step": per_step[len(per_step) // 2] if per_step else None,
        "tokens": [s.new_ids for s in g.sequences],
        "micro": st["micro"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/bench_llama", help="where the checkpoint is (made if missing)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--modes", default="float32,int8,int4")
    ap.add_argument("--rounds", type=int, default=1, help="run the modes this many times in turn")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--engine", default="local", choices=["local", "ray"])
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    path = str(checkpoint(Path(args.dir)))
    from disco_ray.models.graphs import capacity_bounds
    from workloads.llm.checkpoint import Checkpoint

    weights = Checkpoint(path).weight_bytes()
    out: dict = {"weights_bytes": weights, "load": os.getloadavg(), "runs": {}}
    print(f"checkpoint {path}: {weights / 1e9:.2f} GB float32; prompt {args.prompt}, {args.new} new tokens")
    print(f"machine: {torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.1f}")
    print(
        "| batch | round | weights | arena MB | decode new tok/s | vs float32 | step ms | MB loaded/step "
        "| tokens | load avg |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch in map(int, args.batches.split(",")):
        b = capacity_bounds(path, prompt=args.prompt, new_tokens=args.new, batch=batch)
        capacity = max(b.min[0], weights // 4)
        for k in range(args.rounds):
            base = None
            for mode in args.modes.split(","):
                r = run(path, mode, batch, args, capacity)
                out["runs"][f"{mode}-b{batch}-r{k}"] = r | {"capacity": capacity}
                base = base or r
                same = "same" if r["tokens"] == base["tokens"] else "differ"
                loaded = (
                    "-" if r["bytes_loaded_per_step"] is None else f"{r['bytes_loaded_per_step'] / 1e6:.0f}"
                )
                print(
                    f"| {batch} | {k + 1} | {mode} | {capacity / 1e6:.0f} | {r['decode_tokens_per_s']:.2f} | "
                    f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x | {r['step_ms']:.0f} | "
                    f"{loaded} | {same} | {os.getloadavg()[0]:.0f} |",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
