"""Mixtral decode with experts loaded only when routed, against every expert loaded each step.

    PYTHONPATH=. python benchmarks/bench_moe.py [--dir DIR] [--new 8] [--fraction 0.25]

A random Mixtral-shaped checkpoint (8 experts of which 2 are routed per token, 4 layers, hidden
1024, intermediate 2560, vocabulary 8192, float32: about 1.1 GB, 1.0 GB of it experts) is saved
with transformers' `MixtralForCausalLM.save_pretrained` into `--dir` (kept for the next run).
The model runs on one cpu-backend GPU whose arena is `--fraction` of the weights, the weights
streamed from the checkpoint files at each load (`weights="disk"`: host memory holds none).
Two settings, the same tokens: "routed" (each expert's vertices conditional on the router,
docs/FORMATS.md "Conditional vertices") and "all experts" (the conditions off: every expert
loaded and run at every step). Printed per setting: decode tokens/s (the median step), and per
decode step the expert bytes loaded and skipped (the workers' run statistics).

transformers + accelerate disk offload under the same memory limit: `bench_moe_accelerate.py`
(each tool in its own memory cgroup).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time
from pathlib import Path

import torch

from disco_ray.graph.memgraph import MKind
from disco_ray.graph.sizes import format_size
from disco_ray.models import LlamaModel
from workloads.llm.checkpoint import Checkpoint

CONFIG = dict(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2560,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
)
EXPERT = re.compile(r"^l\d+\.e\d+\.")  # an expert weight's input id (workloads.llm.model)
LOADS = (MKind.INPUT, MKind.RELOAD)
PROMPT = [5, 17, 3, 99, 42, 7, 8, 1, 60, 63, 11, 12, 13, 14, 15, 16]


def checkpoint(directory: Path) -> Path:
    """The benchmark's checkpoint in `directory`, saved once."""
    if (directory / "config.json").exists():
        return directory
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**CONFIG)
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(directory)
    return directory


def run(path: Path, fraction: float, new: int, routed: bool) -> dict:
    """One setting: its tokens, decode timings and expert bytes per step."""
    weights = Checkpoint(path).weight_bytes()
    cap = int(weights * fraction)
    with LlamaModel(str(path), capacity=cap, engine="local", weights="disk", block=16) as m:
        if not routed:  # the baseline: the same graphs with no conditional vertex
            cfg = m.ck.config
            assert cfg.moe is not None
            m.ck.config = m.config = dataclasses.replace(
                cfg, moe=dataclasses.replace(cfg.moe, conditional=False)
            )
        steps: list[dict] = []
        inner = m._run

        def recorded(key, ids, pos, gen=None, timeout=None):
            out = inner(key, ids, pos, gen, timeout)
            if key[0] == "decode":
                prog = m._program(key)[1]
                w = prog.statistics()["engine"]["workers"][0]
                # the baseline has no conditional vertex: its expert loads are the plan's, less
                # those the arena still held (loads_skipped counts every such load)
                planned = sum(
                    v.out.nbytes for v in prog.mg.vertices if v.kind in LOADS and EXPERT.search(v.value)
                )
                steps.append(
                    w.get("conditional") or {"load_bytes": planned, "loads_held": w["loads_skipped"]}
                )
            return out

        m._run = recorded
        t = time.perf_counter()
        gen = m.run_generate(PROMPT, new, stop_at_eos=False)
        total = time.perf_counter() - t
    step_s = statistics.median(gen.decode_s)
    return {
        "setting": "routed" if routed else "all experts",
        "weights": weights,
        "capacity": cap,
        "tokens": gen.tokens,
        "decode_tokens_per_s": round(1 / step_s, 3),
        "decode_step_s_median": round(step_s, 4),
        "expert_bytes_loaded_per_step": [s["load_bytes"] for s in steps],
        "expert_bytes_held_per_step": [s.get("held_bytes", 0) for s in steps],
        "expert_bytes_skipped_per_step": [s.get("skipped_bytes", 0) for s in steps],
        "prefill_s": round(gen.prefill_s, 3),
        "total_s": round(total, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/disco_bench_moe", help="where the checkpoint is (made once)")
    ap.add_argument("--new", type=int, default=8, help="new tokens (decode steps + 1)")
    ap.add_argument("--fraction", type=float, default=0.25, help="arena bytes / weight bytes")
    args = ap.parse_args()
    path = checkpoint(Path(args.dir))
    results = [run(path, args.fraction, args.new, routed) for routed in (True, False)]
    assert results[0]["tokens"] == results[1]["tokens"], "the two settings disagree"
    for r in results:
        per = r["expert_bytes_loaded_per_step"]
        print(
            f"{r['setting']:>12}: decode {r['decode_tokens_per_s']:.2f} tokens/s (median step "
            f"{r['decode_step_s_median'] * 1e3:.0f} ms), expert bytes loaded per step "
            f"{format_size(int(statistics.median(per)))} (skipped {format_size(int(statistics.median(r['expert_bytes_skipped_per_step'])))}), "
            f"weights {format_size(r['weights'])}, arena {format_size(r['capacity'])}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
