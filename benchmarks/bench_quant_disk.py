"""A quantized checkpoint on disk against quantizing at load, with `weights="disk"`, on this CPU.

    .venv/bin/python benchmarks/bench_quant_disk.py [--dir /tmp/bench_llama] [--bits 4] [--group 64]
        [--batch 1] [--prompt 32] [--new 4] [--repeat 2] [--json out.json]

The 0.49 GB checkpoint of bench_llama_cpu.py (made once if missing) is quantized once with
`disco-ray quantize` (timed) into DIR-int{bits}-g{group}. Then, alternating (at load, from the
quantized checkpoint, at load, ...), each run in a fresh process (a process keeps the packed files
it made: a second run in it would not pack again) with an arena of a quarter of the float32
weights (or the least any plan needs): the load time (from opening the model to the end of a
first two-token generation: reading the config, planning, the workers loading the graphs, which
quantizing at load packs every weight in, one prefill and one decode step), then greedy decoding
of --new tokens: new tokens/s, the bytes the plans load per step, the bytes read from files per
step (every `FileReader.read`), and how many times the quantizer ran. A benchmark: nothing here
is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_llama_cpu import SHAPE, checkpoint  # noqa: E402


def one(path: str, quantize: str | None, args) -> dict:
    """One run in this process: the figures of the docstring."""
    from actors.tiers import diskio
    from disco_ray.graph import kernels_quant
    from disco_ray.models import LlamaModel
    from disco_ray.models.graphs import capacity_bounds
    from workloads.llm.checkpoint import Checkpoint

    calls, read = [0], [0]
    quantize_fn, read_fn = kernels_quant.quantize, diskio.FileReader.read

    def counted_quantize(w, q):
        calls[0] += 1
        return quantize_fn(w, q)

    def counted_read(self, path, offset, nbytes, buf):
        read[0] += nbytes
        return read_fn(self, path, offset, nbytes, buf)

    kernels_quant.quantize = counted_quantize
    diskio.FileReader.read = counted_read  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    ps = [
        torch.randint(3, SHAPE["vocab_size"], (args.prompt,), generator=gen).tolist()
        for _ in range(args.batch)
    ]
    weights = Checkpoint(args.dir).weight_bytes()  # the float32 checkpoint's: the same arena for both
    b = capacity_bounds(
        path,
        prompt=args.prompt,
        new_tokens=args.new,
        batch=args.batch,
        quantize=quantize,
        quant_group=args.group,
    )
    capacity = max(b.min[0], weights // 4)
    t = time.perf_counter()
    with LlamaModel(
        path, capacity=capacity, engine="local", weights="disk", quantize=quantize, quant_group=args.group
    ) as m:
        m.run_generate_batch(ps, 2, stop_at_eos=False)
        load_s = time.perf_counter() - t
        read[0] = 0
        g = m.run_generate_batch(ps, args.new, stop_at_eos=False)
        st = g.statistics()
    steps = len(st["bytes_loaded_per_step"])
    per_step = sorted(st["bytes_loaded_per_step"])
    return {
        "load_s": load_s,
        "decode_tokens_per_s": (st["new_tokens"] - st["sequences"]) / st["decode_s"],
        "bytes_loaded_per_step": per_step[len(per_step) // 2],
        # the prefill's reads are in it too: per step of the whole generation
        "bytes_read_per_step": read[0] / (steps + 1),
        "quantizer_calls": calls[0],
        "capacity": capacity,
        "tokens": [s.new_ids for s in g.sequences],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/bench_llama", help="where the checkpoint is (made if missing)")
    ap.add_argument("--bits", type=int, default=4, choices=[8, 4])
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each, alternating")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--one", choices=["load", "stored"], help=argparse.SUPPRESS)  # a child's run
    args = ap.parse_args(argv)
    qdir = f"{args.dir.rstrip('/')}-int{args.bits}-g{args.group}"
    if args.one:
        path, q = (args.dir, f"int{args.bits}") if args.one == "load" else (qdir, None)
        print(json.dumps(one(path, q, args)))
        return 0
    checkpoint(Path(args.dir))
    out: dict = {"runs": []}
    if not Path(qdir).exists():
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "disco_ray", "quantize", args.dir, qdir, "--bits", str(args.bits)]
        subprocess.run([*cmd, "--group", str(args.group)], check=True, cwd=ROOT)
        out["quantize_s"] = time.perf_counter() - t
        print(f"disco-ray quantize: {out['quantize_s']:.1f} s (load average {os.getloadavg()[0]:.1f})")
    sizes = {p: sum(f.stat().st_size for f in Path(p).glob("*.safetensors")) for p in (args.dir, qdir)}
    print(f"{args.dir}: {sizes[args.dir] / 1e6:.0f} MB; {qdir}: {sizes[qdir] / 1e6:.0f} MB")
    print(
        "| run | weights | load s | decode new tok/s | MB loaded/step | MB read/step | quantizer calls | load avg |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    argv = argv if argv is not None else sys.argv[1:]
    for k in range(args.repeat):
        for mode in ("load", "stored"):
            got = subprocess.run(
                [sys.executable, __file__, *argv, "--one", mode], check=True, capture_output=True, text=True
            )
            r = json.loads(got.stdout.strip().splitlines()[-1]) | {"mode": mode, "load": os.getloadavg()[0]}
            out["runs"].append(r)
            what = f"int{args.bits} at load" if mode == "load" else f"int{args.bits} stored"
            print(
                f"| {k + 1} | {what} | {r['load_s']:.1f} | {r['decode_tokens_per_s']:.2f} | "
                f"{r['bytes_loaded_per_step'] / 1e6:.0f} | {r['bytes_read_per_step'] / 1e6:.0f} | "
                f"{r['quantizer_calls']} | {r['load']:.1f} |",
                flush=True,
            )
    same = len({json.dumps(r["tokens"]) for r in out["runs"]}) == 1
    print(f"tokens: {'the same in every run' if same else 'differ'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
