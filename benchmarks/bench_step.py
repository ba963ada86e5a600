"""The runtime's own cost per decode step: wall time minus the union of its vertices' intervals.

    .venv/bin/python benchmarks/bench_step.py [--model tiny|bench] [--engine ray|local]
        [--gpus 1] [--streams S] [--steps 40] [--prompt 128] [--steps-per-call K] [--dir /tmp/bench_llama]
        [--json out.json]

One LLaMA checkpoint (`tiny`: 2 layers, hidden 64, made here; `bench`: the 0.49 GB checkpoint
of benchmarks/bench_llama_cpu.py), one GPU (`--gpus`: split over more), batch 1, a roomy arena. After a prompt and a few
warm-up steps (plans made, weights in the arena), `--steps` runs of the same decode step, each
timed around `Program.run`: its wall time, the union of its trace records' intervals (what the
worker's streams and lanes were busy with) and the rest, the runtime's own share (the driver's
call, messages, the worker's bookkeeping, waiting). Also where the rest lies: before the first
vertex starts, after the last one ends, and between vertices. Median and best (lowest wall) of
the steps. `--steps-per-call K` (K >= 1) times instead the batch decode step that samples on
the device (`run_generate_batch`'s), K steps per `Program.run_steps` call (none halts): per step,
the call's wall time, vertices and own time over its K steps (each step's outputs stream back
as it ends), and of the time between vertices, the gaps between a call's steps. `--streams`:
the compute streams per worker (default: the model's, 1 on the cpu backend). A benchmark: it
measures and prints; nothing here is a test.
"""

from __future__ import annotations

import argparse
import itertools
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


def measure(
    path: Path, engine: str, steps: int, prompt: int, gpus: int = 1, streams: int | None = None
) -> dict:
    from disco_ray.models import LlamaModel
    from disco_ray.models.graphs import capacity_bounds

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    cap = capacity_bounds(str(path), gpus=gpus, prompt=prompt, new_tokens=8).roomy[0]
    with LlamaModel(str(path), gpus=gpus, capacity=cap, engine=engine, streams=streams) as m:
        g = m.run_generate(ids, 4, stop_at_eos=False)  # plans, weights into the arena
        streams_of = m._prog_kw["streams"]
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
        "streams": streams_of,
        "median": med,
        "best": {k: round(v, 3) for k, v in best.items()},
    }


def step_feeds(m, prog_key: tuple, layout, tok: int, p: int, k: int) -> list[dict]:
    """K steps of the batch decode graph of `prog_key` from cache index p, one row, greedy, never
    halting (a maximum far away): what `decode_calls.decode_call` hands `run_steps`."""
    from workloads.llm.batch import feed_decode
    from workloads.llm.decode_sample import feed_sampling

    mgraph, _ = m._program(prog_key)
    knobs = torch.tensor([0.0, 0, 1.0], dtype=torch.float64)
    stops = torch.full((1, prog_key[-1]), -1, dtype=torch.int64)
    feeds = []
    for j in range(k):
        feed = feed_decode(mgraph, m.config, layout, [tok], p + j, 1)
        if j:
            feed = {x: v for x, v in feed.items() if not x.startswith("tok_")}
        u, left = torch.zeros(1, dtype=torch.float64), torch.tensor([1 << 20])
        feeds.append(
            feed | feed_sampling(mgraph, u, left, knobs if j == 0 else None, stops if j == 0 else None)
        )
    return feeds


def measure_calls(
    path: Path, engine: str, steps: int, prompt: int, k: int, gpus: int = 1, streams: int | None = None
) -> dict:
    """As `measure`, for the sampling decode step, `k` steps per call: per step = per call / k."""
    from disco_ray.models import LlamaModel
    from disco_ray.models.decode_calls import MIN_STOPS
    from disco_ray.models.graphs import capacity_bounds
    from workloads.llm.batch import BatchLayout
    from workloads.llm.decode_sample import token_carry

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    cap = capacity_bounds(str(path), gpus=gpus, prompt=prompt, new_tokens=8, batch=1).roomy[0]
    with LlamaModel(str(path), gpus=gpus, capacity=cap, engine=engine, streams=streams) as m:
        g = m.run_generate_batch([ids], 4, stop_at_eos=False, steps_per_call=k)  # plans, weights in
        layout = BatchLayout.of([prompt], m.block, 1)
        p = layout.length  # the first index of a cache block: k <= block steps stay in it
        key = ("batch_decode", 1, p // m.block + 1, 1, MIN_STOPS)
        mgraph, prog = m._program(key)
        feeds = step_feeds(m, key, layout, g.sequences[0].new_ids[-1], p, k)
        carry, halt = token_carry(mgraph), mgraph.finished
        for _ in range(3):
            prog.run_steps(feeds, carry=carry, halt=halt)
        rows = []
        for _ in range(max(1, steps // k)):
            t0 = time.time_ns()  # the clock of the trace records
            done = len(prog.run_steps(feeds, carry=carry, halt=halt))
            t1 = time.time_ns()
            iv = [(a, b) for step in prog.last_steps for recs in step for _, _, a, b in recs]
            busy = union_ns(iv)
            first, last = min(a for a, _ in iv), max(b for _, b in iv)
            ends = [
                (min(r[2] for recs in st for r in recs), max(r[3] for recs in st for r in recs))
                for st in prog.last_steps
            ]
            gaps = sum(
                b[0] - a[1] for a, b in itertools.pairwise(ends)
            )  # a step's last vertex to the next's first
            rows.append(
                {
                    "wall_ms": (t1 - t0) / 1e6 / done,
                    "kernels_ms": busy / 1e6 / done,
                    "own_ms": (t1 - t0 - busy) / 1e6 / done,
                    "before_first_ms": (first - t0) / 1e6 / done,
                    "after_last_ms": (t1 - last) / 1e6 / done,
                    "between_ms": (last - first - busy) / 1e6 / done,
                    "between_steps_ms": gaps / 1e6 / done,
                }
            )
    med = {x: round(statistics.median(r[x] for r in rows), 3) for x in rows[0]}
    best = min(rows, key=lambda r: r["wall_ms"])
    return {
        "vertices": len(iv) // done,
        "steps": len(rows) * done,
        "steps_per_call": k,
        "streams": m._prog_kw["streams"],
        "median": med,
        "best": {x: round(v, 3) for x, v in best.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "bench"), default="tiny")
    ap.add_argument("--engine", choices=("ray", "local"), default="ray")
    ap.add_argument("--gpus", type=int, default=1, help="workers the model is split over")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--streams", type=int, help="compute streams per worker (default: the model's)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument(
        "--steps-per-call",
        type=int,
        default=0,
        metavar="K",
        help="time the sampling batch decode step, K per call (0: the single-sequence step, one per run)",
    )
    ap.add_argument("--dir", default=None, help="the checkpoint (made if missing)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    if args.model == "tiny":
        path = tiny_checkpoint(Path(args.dir or "/tmp/bench_llama_tiny"))
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_llama_cpu import checkpoint

        path = checkpoint(Path(args.dir or "/tmp/bench_llama"))
    if args.steps_per_call:
        r = measure_calls(
            path, args.engine, args.steps, args.prompt, args.steps_per_call, args.gpus, args.streams
        )
    else:
        r = measure(path, args.engine, args.steps, args.prompt, args.gpus, args.streams)
    r.update(model=args.model, engine=args.engine, gpus=args.gpus, prompt=args.prompt, root=str(ROOT))
    for name in ("median", "best"):
        x = r[name]
        print(
            f"{args.model} {args.engine} {args.gpus} GPU K={args.steps_per_call} {name}: step {x['wall_ms']:.2f} ms = vertices {x['kernels_ms']:.2f} "
            f"+ own {x['own_ms']:.2f} (before the first vertex {x['before_first_ms']:.2f}, after the "
            f"last {x['after_last_ms']:.2f}, between {x['between_ms']:.2f}"
            + (f", of which between steps {x['between_steps_ms']:.2f}" if "between_steps_ms" in x else "")
            + f"); {r['vertices']} vertices, {r['streams']} streams"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
