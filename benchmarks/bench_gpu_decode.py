"""Decode on the cuda backend: new tokens/s per launch-ahead depth and batch, the launch loop's
host statistics, and the device memory torch reserved against the arena's capacity.

    python3 benchmarks/bench_gpu_decode.py [--dir /tmp/bench_llama] [--batches 1,16] [--ahead 0,4]
        [--prompt 128] [--new 32] [--capacity 4GiB] [--dtype float16] [--weights host|disk]
        [--engine local] [--streams 5] [--repeat 2] [--json out.json] [--checkpoint-only] [--peer]
        [--profile FILE]

The checkpoint is benchmarks/bench_llama_cpu.py's (made once with transformers: 8 layers, hidden
1024, 0.49 GB in float32). For each --ahead depth a `LlamaModel` on one GPU (cuda backend, the
local engine by default, so the worker and its memory are in this process); for each batch,
`batch` random prompts of --prompt tokens, --new greedy new tokens each (no stop at EOS), a
warm-up call (plans, weight reads) then --repeat timed calls. Printed per (ahead, batch):

- new tokens/s: batch x new over the call's wall time, prefill included (best of --repeat);
- the loop's host statistics summed over the model's programs since they were made
  (`actors.backends.cuda`): launches, launch_us_mean (host time in `work` per vertex the loop
  launched itself), idle_s (asleep with vertices in flight), blocking (run by helpers);
- max_memory_reserved: the most torch's allocator held on the device in this process, against
  the capacity (the arena) and the rest (kernel temporaries kept per stream, cuBLAS).

With --peer, the same prompts through transformers' `generate` on the same GPU, everything in
memory (the in-memory peer: what a model that fits costs without disco-ray). With --profile, the
model's life (plans, warm-up and timed calls) is sampled in every thread: the functions most
often on top of each thread's stack are printed and written to FILE.ahead<A> (where the host's
time per vertex goes).

A benchmark: it measures and prints; nothing here is a test. Needs a GPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def host_totals(model) -> dict:
    """The cuda backend's host counters summed over the model's programs (local engine)."""
    launches = own = blocking = 0
    launch_s = idle_s = 0.0
    for _, prog in model._programs.values():
        for w in prog.statistics()["engine"]["workers"]:
            h = w.get("backend", {}).get("host")
            if h is None:
                continue
            launches += h["launches"]
            blocking += h["blocking"]
            own += h["launches"] - h["blocking"]
            launch_s += h["launch_s"]
            idle_s += h["idle_s"]
    return {
        "launches": launches,
        "launch_us_mean": round(launch_s / own * 1e6, 2) if own else 0.0,
        "idle_s": round(idle_s, 4),
        "blocking": blocking,
    }


@contextlib.contextmanager
def profiled(path: str | None, every_s: float = 5e-4):
    """A sampling profile of the block: every `every_s` the stacks of all threads (the launch loop,
    its wakers and helpers) are read (`sys._current_frames`) and counted per thread name and
    function, own (the top frame) and inclusive; the top functions are printed and written to
    `path`. Samples slow Python little (one reader thread), where cProfile would hook every call
    (and from Python 3.12 on, one profiler per interpreter)."""
    if not path:
        yield
        return
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    samples: collections.Counter = collections.Counter()
    stop = threading.Event()

    def sample() -> None:
        me = threading.get_ident()
        while not stop.wait(every_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = re.sub(r"-\d+$", "", names.get(ident, "?")) if ident != main else "main"
                samples[name] += 1
                seen = set()
                f, top = frame, True
                while f is not None:
                    key = (name, f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}")
                    if top:
                        own[key] += 1
                        top = False
                    if key not in seen:
                        incl[key] += 1
                        seen.add(key)
                    f = f.f_back

    main = threading.get_ident()
    reader = threading.Thread(target=sample, daemon=True)
    reader.start()
    try:
        yield
    finally:
        stop.set()
        reader.join()
        lines = [f"samples per thread: {dict(samples)}"]
        for title, counts in (("own", own), ("inclusive", incl)):
            lines.append(f"-- top functions by {title} samples (share of the thread's samples)")
            for (name, fn), c in counts.most_common(40):
                lines.append(f"{name:>10}  {c / samples[name]:6.1%}  {fn}")
        Path(path).write_text("\n".join(lines) + "\n")
        print(f"-- profile {path}", flush=True)
        print("\n".join(lines[:60]), flush=True)


def peer(args, batches: list[int]) -> list[dict]:
    """transformers' greedy `generate` on the GPU, the model in memory, the same prompts."""
    import torch
    import transformers

    dtype = getattr(torch, args.dtype)
    model = transformers.LlamaForCausalLM.from_pretrained(args.dir, dtype=dtype).cuda().eval()
    out = []
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        x = torch.randint(3, 32000, (batch, args.prompt), generator=gen).cuda()

        def call(model=model, x=x):
            with torch.no_grad():
                model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=args.new,
                    min_new_tokens=args.new,
                    do_sample=False,
                )
            torch.cuda.synchronize()

        call()  # warm-up
        best = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
        row = {"peer": "transformers", "batch": batch, "new_tokens_per_s": round(batch * args.new / best, 2)}
        out.append(row)
        print(f"transformers  batch {batch:3d}  {row['new_tokens_per_s']:10.1f} new tokens/s", flush=True)
    model.cpu()
    torch.cuda.empty_cache()
    return out


def run(args, ahead: int, batches: list[int]) -> list[dict]:
    import torch

    from disco_ray.graph.sizes import parse_capacity
    from disco_ray.models.llama import LlamaModel

    torch.cuda.reset_peak_memory_stats()
    cap = parse_capacity(args.capacity)
    model = LlamaModel(
        str(args.dir),
        capacity=cap,
        dtype=args.dtype,
        engine=args.engine,
        backend="cuda",
        weights=args.weights,
        ahead=ahead,
        streams=args.streams,
    )
    out = []
    try:
        gen = torch.Generator().manual_seed(0)
        for batch in batches:
            prompts = [torch.randint(3, 32000, (args.prompt,), generator=gen).tolist() for _ in range(batch)]
            model.generate(prompts, args.new, stop_at_eos=False)  # warm-up: plans, weight reads
            best = float("inf")
            for _ in range(args.repeat):
                t = time.perf_counter()
                model.generate(prompts, args.new, stop_at_eos=False)
                best = min(best, time.perf_counter() - t)
            torch.cuda.synchronize()
            row = {
                "ahead": ahead,
                "batch": batch,
                "weights": args.weights,
                "new_tokens_per_s": round(batch * args.new / best, 2),
                "wall_s": round(best, 4),
                "host": host_totals(model),
                "max_memory_reserved": torch.cuda.max_memory_reserved(),
                "capacity": cap,
            }
            row["reserved_over_capacity"] = round(row["max_memory_reserved"] / cap, 3)
            out.append(row)
            h = row["host"]
            print(
                f"ahead {ahead:2d}  batch {batch:3d}  {row['new_tokens_per_s']:10.1f} new tokens/s  "
                f"launch_us_mean {h['launch_us_mean']:7.1f}  idle {h['idle_s']:8.3f} s  "
                f"launches {h['launches']:7d}  max_memory_reserved {row['max_memory_reserved'] / 2**30:6.2f} GiB "
                f"({row['reserved_over_capacity']:.2f}x the capacity)",
                flush=True,
            )
    finally:
        model.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dir", type=Path, default=Path("/tmp/bench_llama"), help="the checkpoint (made if missing)"
    )
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--ahead", default="0,4", help="comma-separated launch-ahead depths")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--new", type=int, default=32, help="new tokens per sequence")
    ap.add_argument("--capacity", default="4GiB", help="arena bytes of the GPU")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--weights", default="host", choices=["host", "disk"])
    ap.add_argument("--engine", default="local", choices=["local", "ray"])
    ap.add_argument("--streams", type=int, help="compute streams (default: the model's, 5 on cuda)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--peer", action="store_true", help="also time transformers' generate (in memory)")
    ap.add_argument(
        "--profile", help="sample all threads' stacks over each model's life; counts to FILE.ahead<A>"
    )
    ap.add_argument("--checkpoint-only", action="store_true", help="make the checkpoint in --dir and exit")
    args = ap.parse_args(argv)
    from benchmarks.bench_llama_cpu import checkpoint

    if args.checkpoint_only:
        checkpoint(args.dir)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu_decode.py: needs a GPU (torch sees no CUDA device)", file=sys.stderr)
        return 2
    checkpoint(args.dir)
    print(
        f"device: {torch.cuda.get_device_name()}  checkpoint {args.dir}  dtype {args.dtype}  weights {args.weights}"
    )
    batches = [int(b) for b in args.batches.split(",")]
    rows = peer(args, batches) if args.peer else []
    for a in args.ahead.split(","):
        with profiled(args.profile and f"{args.profile}.ahead{a}"):  # the model's life: plans included
            rows += run(args, int(a), batches)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
