"""micro="auto" against micro=1 on this CPU: each step's micro-batches chosen by the plans (the
fewest bytes moved between host and device) at a roomy arena and at a tight one.

    .venv/bin/python benchmarks/bench_micro.py [--dir /tmp/bench_micro] [--repeat 3]

A tiny random LLaMA (the tests' `make_checkpoint`, 2 KV heads), three prompts of 3, 17 and 69
tokens, 6-9 new tokens each (greedy, no stop), local engine, cpu backend, blocks of 4. The tight
arena is a tenth of the way from the least capacity of the 4-row decode step to room for all its
tensors. Per case: the micro-batches of each decode step, the median step's bytes loaded (inputs
and reloads, as run) and its milliseconds, best of --repeat after a warm-up call. A benchmark:
it measures and prints.
"""

from __future__ import annotations

import argparse
import os

from disco_ray.models import LlamaModel
from planner import min_capacity, roomy_capacity
from tests.test_batch_generate import BLOCK, MAX_NEW, PROMPTS
from tests.test_models import make_checkpoint
from workloads.llm.batch import batch_decode_graph
from workloads.llm.checkpoint import Checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/bench_micro")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.dir, "config.json")):
        make_checkpoint(a.dir, num_key_value_heads=2, tie_word_embeddings=False)
    step = batch_decode_graph(Checkpoint(a.dir), 1, 4, 19, BLOCK).taskgraph
    lo, hi = min_capacity(step)[0], roomy_capacity(step)[0]
    print("| arena | micro | micro per decode step | bytes loaded per step | decode step ms |")
    print("| --- | --- | --- | --- | --- |")
    with LlamaModel(a.dir, capacity=2 * hi, block=BLOCK, engine="local") as m:
        for name, cap in (("roomy", 2 * hi), ("tight", lo + (hi - lo) // 10)):
            m.resize(cap)
            for micro in (1, "auto"):
                m.run_generate_batch(PROMPTS, MAX_NEW, stop_at_eos=False, micro=micro)  # plans
                runs = [
                    m.run_generate_batch(PROMPTS, MAX_NEW, stop_at_eos=False, micro=micro)
                    for _ in range(a.repeat)
                ]
                g = min(runs, key=lambda g: sorted(g.decode_s)[len(g.decode_s) // 2])
                step_ms = 1e3 * sorted(g.decode_s)[len(g.decode_s) // 2]
                moved = sorted(g.bytes_loaded)[len(g.bytes_loaded) // 2]
                micros = ", ".join(map(str, g.micros))
                print(f"| {name} ({cap} B) | {micro} | {micros} | {moved} | {step_ms:.2f} |")


if __name__ == "__main__":
    main()
