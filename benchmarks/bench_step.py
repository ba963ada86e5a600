"""The runtime's own cost per decode step: wall time minus the union of its vertices' intervals.

    .venv/bin/python benchmarks/bench_step.py [--model tiny|bench] [--engine ray|local]
        [--gpus 1] [--steps 40] [--prompt 128] [--dir /tmp/bench_llama] [--json out.json]

One LLaMA checkpoint (`tiny`: 2 layers, hidden 64, made here; `bench`: the 0.49 GB checkpoint
of benchmarks/bench_llama_cpu.py), one GPU (`--gpus`: split over more), batch 1, a roomy arena. After a prompt and a few
warm-up steps (plans made, weights in the arena), `--steps` runs of the same decode step, each
timed around `Program.run`: its wall time, the union of its trace records' intervals (what the
worker's streams and lanes were busy with) and the rest, the runtime's own share (the driver's
call, messages, the worker's bookkeeping, waiting). Also where the rest lies: before the first
vertex starts, after the last one ends, and between vertices. Median and best (lowest wall) of
the steps. A benchmark: it measures and prints; nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_checkpoint(path: Path) -> Path:
    if not (path / "config.json").exists():
        import transformers

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(path)
    return path


def union_ns(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by at least one interval."""
    busy, end = 0, 0
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def measure(path: Path, engine: str, steps: int, prompt: int, gpus: int = 1) -> dict:
    from disco_ray.models import LlamaModel
    from disco_ray.models.graphs import capacity_bounds

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    cap = capacity_bounds(str(path), gpus=gpus, prompt=prompt, new_tokens=8)["roomy"][0]
    with LlamaModel(str(path), gpus=gpus, capacity=cap, engine=engine) as m:
        g = m.run_generate(ids, 4, stop_at_eos=False)  # plans, weights into the arena
        key = max(k for k in m._programs if k[0] == "decode")
        mgraph, prog = m._programs[key]
        feed = mgraph.feed(m.config, [g.tokens[-1]], prompt + 2)
        for _ in range(3):
            prog.run(feed)
        rows = []
        for _ in range(steps):
            t0 = time.time_ns()  # the clock of the trace records
            prog.run(feed)
            t1 = time.time_ns()
            iv = [(a, b) for recs in prog.last_records or [] for _, _, a, b in recs]
            busy = union_ns(iv)
            first, last = min(a for a, _ in iv), max(b for _, b in iv)
            rows.append(
                {
                    "wall_ms": (t1 - t0) / 1e6,
                    "kernels_ms": busy / 1e6,
                    "own_ms": (t1 - t0 - busy) / 1e6,
                    "before_first_ms": (first - t0) / 1e6,
                    "after_last_ms": (t1 - last) / 1e6,
                    "between_ms": (last - first - busy) / 1e6,
                }
            )
    med = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    best = min(rows, key=lambda r: r["wall_ms"])
    return {
        "vertices": len(iv),
        "steps": steps,
        "median": med,
        "best": {k: round(v, 3) for k, v in best.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "bench"), default="tiny")
    ap.add_argument("--engine", choices=("ray", "local"), default="ray")
    ap.add_argument("--gpus", type=int, default=1, help="workers the model is split over")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--dir", default=None, help="the checkpoint (made if missing)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    if args.model == "tiny":
        path = tiny_checkpoint(Path(args.dir or "/tmp/bench_llama_tiny"))
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_llama_cpu import checkpoint

        path = checkpoint(Path(args.dir or "/tmp/bench_llama"))
    r = measure(path, args.engine, args.steps, args.prompt, args.gpus)
    r.update(model=args.model, engine=args.engine, gpus=args.gpus, prompt=args.prompt, root=str(ROOT))
    for name in ("median", "best"):
        x = r[name]
        print(
            f"{args.model} {args.engine} {args.gpus} GPU {name}: step {x['wall_ms']:.2f} ms = vertices {x['kernels_ms']:.2f} "
            f"+ own {x['own_ms']:.2f} (before the first vertex {x['before_first_ms']:.2f}, after the "
            f"last {x['after_last_ms']:.2f}, between {x['between_ms']:.2f}); {r['vertices']} vertices"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
