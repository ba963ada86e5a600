"""Elastic capacity on this CPU: greedy decode at 100%, 50% and 25% of the roomy capacity, and the
time from a resize request to the memory being free.

    .venv/bin/python benchmarks/bench_elastic.py [--dir /tmp/bench_llama] [--prompt 512] [--new 16]
        [--engine ray|local] [--json out.json]

The checkpoint is bench_llama_cpu.py's (made once if missing: 8 layers, hidden 1024, GQA, float32,
0.49 GB). One LlamaModel decodes after the prompt, is resized (`LlamaModel.resize`: every arena
freed, plans kept per capacity) and decodes again; the plans at the smaller capacities reload
weights each step. Tokens are compared across capacities. A benchmark: it measures and prints;
nothing here is a test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_llama_cpu import arguments, checkpoint, prompt_ids  # noqa: E402


def section_elastic(path: Path, ids: list[int], new: int, engine: str, out: dict) -> None:
    from disco_ray.models import LlamaModel
    from disco_ray.models.graphs import capacity_bounds

    bounds = capacity_bounds(str(path), prompt=len(ids), new_tokens=new)
    roomy = bounds.roomy[0]
    least = bounds.min[0]
    print(
        f"\n== elastic: greedy decode after a {len(ids)}-token prompt, {new} new tokens, {engine} engine =="
    )
    print(
        "| capacity | bytes per GPU | decode tok/s | input loads skipped per step (kept in the arena) | resize: request to memory free |"
    )
    print("| --- | --- | --- | --- | --- |")
    rows = []
    with LlamaModel(str(path), capacity=roomy, engine=engine) as m:
        m.run_generate(ids, new, stop_at_eos=False)  # warm-up at 100%
        first = None
        for share in (1.0, 0.5, 0.25):
            cap = max(least, int(roomy * share))
            r = m.resize(cap)
            m.run_generate(ids, 2, stop_at_eos=False)  # the plans at this capacity
            g = m.run_generate(ids, new, stop_at_eos=False)
            st = g.statistics()
            key = max(k for k in m._programs if k[0] == "decode")
            prog = m._programs[key][1]
            skipped = sum(w["loads_skipped"] for w in prog.statistics()["engine"]["workers"])
            inputs = sum(1 for v in prog.mg.vertices if v.kind.value == "input")
            first = first or st["decode_tokens_per_s"]
            rows.append({"share": share, "capacity": cap, "tokens": g.tokens, **st, "free_s": r["free_s"]})
            print(
                f"| {share:.0%} | {cap / 1e6:.0f} MB | {st['decode_tokens_per_s']:.1f} | "
                f"{skipped} of {inputs} | {1e3 * r['free_s']:.1f} ms |"
            )
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"tokens the same at every capacity: {same}")
    out["elastic"] = {
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        "same_tokens": same,
    }


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, new=16, repeat=1)
    ap.add_argument("--engine", default="ray", choices=["ray", "local"])
    args = ap.parse_args(argv)
    path = checkpoint(Path(args.dir))
    print(f"checkpoint {path}; {torch.get_num_threads()} torch threads, torch {torch.__version__}, CPU only")
    out: dict = {}
    section_elastic(path, prompt_ids(args.prompt), args.new, args.engine, out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
