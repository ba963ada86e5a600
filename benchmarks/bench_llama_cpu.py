"""Prefill and decode of a LLaMA-shaped checkpoint: disco-ray against transformers, on this CPU.

    .venv/bin/python benchmarks/bench_llama_cpu.py [--dir /tmp/bench_llama] [--prompt 512] [--new 32]
        [--engines local,ray] [--capacities roomy,third] [--repeat 3] [--json out.json]

Makes (once) a random checkpoint with `save_pretrained`: 8 layers, hidden 1024, 16 heads with 4
key/value heads, intermediate 2816, vocabulary 32000 with tied embeddings, float32: 0.49 GB.
Then, for transformers with everything in memory and for disco-ray per engine and capacity
("roomy": the plans offload nothing; "third": a third of the weights per GPU):

- prefill: seconds for the logits of a prompt of --prompt tokens (best of --repeat, after a
  warm-up run; for disco-ray the first run also moves the weights into the arena);
- decode: tokens per second over --new greedy tokens after that prompt (best of --repeat);
- per decode step (disco-ray): the step's wall time, the time the worker's kernels ran (union of
  their intervals) and the rest, which is the runtime's own cost (host time, messages, idle);
- planning: seconds per plan, made once per prompt length and per cache block.

Greedy tokens are compared with transformers' and the figures printed as a table. A benchmark:
it measures and prints; nothing here is a test.
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

SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def checkpoint(path: Path) -> Path:
    if not (path / "config.json").exists():
        import transformers

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
        model.save_pretrained(path)
    return path


def best(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def bench_transformers(path: Path, ids: list[int], new: int, repeat: int) -> dict:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        model(x)  # warm-up
        prefill, _ = best(lambda: model(x).logits, repeat)

        def gen(n):
            return model.generate(
                x, max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(x)
            )

        gen(2)
        one, _ = best(lambda: gen(1), repeat)
        full, out = best(lambda: gen(new), repeat)
    return {
        "prefill_s": prefill,
        "decode_tokens_per_s": (new - 1) / (full - one),
        "tokens": out[0, len(ids) :].tolist(),
        "threads": torch.get_num_threads(),
    }


def bench_disco(path: Path, ids: list[int], new: int, repeat: int, engine: str, capacity: int) -> dict:
    from disco_ray.models import LlamaModel

    with LlamaModel(str(path), capacity=capacity, engine=engine) as m:
        m.prefill(ids)  # warm-up: plans, loads the weights, moves them into the arena
        prefill, _ = best(lambda: m.prefill(ids), repeat)
        m.run_generate(ids, new, stop_at_eos=False)  # warm-up: the decode plans
        rates, gens = [], []
        for _ in range(repeat):
            g = m.run_generate(ids, new, stop_at_eos=False)
            gens.append(g)
            rates.append(g.statistics()["decode_tokens_per_s"])
        g = gens[rates.index(max(rates))]
        # one more decode step, its records: kernel time against the step's wall time
        key = max(k for k in m._programs if k[0] == "decode")
        mgraph, prog = m._programs[key]
        steps = []
        p = len(ids) + new - 2
        for _ in range(5):
            t = time.perf_counter()
            prog.run(mgraph.feed(m.config, [g.tokens[-1]], p))
            wall = time.perf_counter() - t
            iv = sorted((a, b) for recs in prog.last_records or [] for _, _, a, b in recs)
            busy, end = 0, 0
            for a, b in iv:
                if b > end:
                    busy += b - max(a, end)
                    end = b
            steps.append((wall, busy / 1e9, len(iv)))
        wall, busy, n = min(steps)
        return {
            "prefill_s": prefill,
            "decode_tokens_per_s": max(rates),
            "tokens": g.tokens,
            "step_ms": 1e3 * wall,
            "step_kernels_ms": 1e3 * busy,
            "step_runtime_ms": 1e3 * (wall - busy),
            "step_vertices": n,
            "step_bytes_reloaded": prog.mg.stats.get("bytes_reloaded", 0),
            "plans": m.plans,
            "load_s": m.load_s,
        }


def arguments(doc: str, new: int, repeat: int) -> argparse.ArgumentParser:
    """The options every benchmark on this checkpoint takes."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/bench_llama", help="where the checkpoint is (made if missing)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=new)
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--json", help="write the figures here too")
    return ap


def prompt_ids(n: int) -> list[int]:
    """A fixed random prompt of `n` token ids."""
    return torch.randint(0, SHAPE["vocab_size"], (n,), generator=torch.Generator().manual_seed(0)).tolist()


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, new=32, repeat=3)
    ap.add_argument("--engines", default="local,ray")
    ap.add_argument("--capacities", default="roomy,third")
    args = ap.parse_args(argv)
    path = checkpoint(Path(args.dir))
    from disco_ray.models.graphs import capacity_bounds
    from workloads.llm.checkpoint import Checkpoint

    ids = prompt_ids(args.prompt)
    weights = Checkpoint(path).weight_bytes()
    bounds = capacity_bounds(str(path), prompt=args.prompt, new_tokens=args.new)
    caps = {"roomy": bounds.roomy[0], "third": max(bounds.min[0], weights // 3)}
    print(f"checkpoint {path}: {weights / 1e9:.2f} GB float32; prompt {args.prompt}, {args.new} new tokens")
    print(f"machine: {torch.get_num_threads()} torch threads, torch {torch.__version__}, CPU only")
    results: dict = {"weights_bytes": weights, "prompt": args.prompt, "new": args.new, "runs": {}}
    hf = bench_transformers(path, ids, args.new, args.repeat)
    results["runs"]["transformers"] = hf
    rows = [("transformers (in memory)", hf["prefill_s"], hf["decode_tokens_per_s"], None)]
    for engine in args.engines.split(","):
        for cname in args.capacities.split(","):
            r = bench_disco(path, ids, args.new, args.repeat, engine, caps[cname])
            r["capacity"] = caps[cname]
            r["same_tokens"] = r["tokens"] == hf["tokens"]
            results["runs"][f"disco-{engine}-{cname}"] = r
            rows.append(
                (
                    f"disco-ray {engine}, {cname} ({caps[cname] / 1e6:.0f} MB)",
                    r["prefill_s"],
                    r["decode_tokens_per_s"],
                    r,
                )
            )
    print()
    print(
        "| run | prefill s | vs transformers | decode tok/s | vs transformers | step ms (kernels + runtime) | tokens |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, pre, rate, r in rows:
        step = (
            "-"
            if r is None
            else f"{r['step_ms']:.1f} ({r['step_kernels_ms']:.1f} + {r['step_runtime_ms']:.1f})"
        )
        same = "-" if r is None else ("same" if r["same_tokens"] else "DIFFER")
        print(
            f"| {name} | {pre:.3f} | {pre / hf['prefill_s']:.2f}x | {rate:.1f} | "
            f"{hf['decode_tokens_per_s'] / rate:.2f}x slower | {step} | {same} |"
        )
    plans = [p for r in results["runs"].values() for p in r.get("plans", [])]
    if plans:
        by: dict[str, list[float]] = {}
        for p in plans:
            by.setdefault(p["graph"].split("/")[0], []).append(p["planning_s"])
        print(
            "planning: "
            + ", ".join(
                f"{k} median {1e3 * statistics.median(v):.1f} ms ({len(v)} plans)" for k, v in by.items()
            )
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
