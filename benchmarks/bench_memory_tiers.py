"""Memory tiers on this CPU: a checkpoint streamed from disk under a RAM budget, and elastic capacity.

    .venv/bin/python benchmarks/bench_memory_tiers.py [--dir /tmp/bench_llama] [--prompt 512]
        [--new 16] [--only disk,elastic] [--repeat 2] [--json out.json]

The checkpoint is bench_llama_cpu.py's (made once if missing: 8 layers, hidden 1024, GQA, float32,
0.49 GB).

disk: prefill of --prompt tokens with a RAM budget of a third of the weights, cold (the page cache
dropped before each timed run through /proc/sys/vm/drop_caches when this process may write it; the
table says when it could not):
- disco-ray, `weights="disk"`: each worker reads its blocks of the safetensors file (O_DIRECT) when
  the plan loads them, overlapped with compute; the arena (the RAM budget) is a third of the weights;
- transformers + accelerate, `device_map="auto"` with `max_memory` at the same budget and an
  `offload_folder` (accelerate's disk offload);
- transformers with everything in memory (warm), the compute time to compare with;
- the disk's bandwidth: the file read once with O_DIRECT.
The goal printed: disco-ray cold within 1.15x of max(in-memory compute, file bytes / bandwidth).

elastic: greedy decode tokens/s at 100%, 50% and 25% of the roomy capacity (the plans at the
smaller ones reload weights each step), and the time from a resize request to the memory being free.
A benchmark: it measures and prints; nothing here is a test.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_llama_cpu import arguments, checkpoint, prompt_ids  # noqa: E402


def drop_caches() -> bool:
    """Drops the page cache (dirty pages written first); False where this process may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_bandwidth(files: list[Path]) -> tuple[float, int]:
    """Reads `files` once with O_DIRECT (buffered where the file system refuses it): GB/s, bytes."""
    from actors.diskio import FileReader, aligned

    reader = FileReader()
    block = 64 << 20
    buf = aligned(block + 8192, lambda n, _: torch.empty(n, dtype=torch.uint8))
    total = 0
    t = time.perf_counter()
    for f in files:
        size = f.stat().st_size
        for off in range(0, size, block):
            n = min(block, size - off)
            reader.read(str(f), off, n, buf)
            total += n
    secs = time.perf_counter() - t
    reader.close()
    return total / secs / 1e9, total


def timed(fn, repeat: int, cold: bool) -> tuple[float, bool]:
    """Best of `repeat` calls of `fn`, each after dropping the page cache when `cold`."""
    best, dropped = float("inf"), cold
    for _ in range(repeat):
        if cold:
            dropped = drop_caches() and dropped
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best, dropped


def forward_time(model, x: torch.Tensor, repeat: int, cold: bool) -> tuple[float, bool, float]:
    """`model`'s best forward time on `x` (after a warm-up), whether the cache was dropped, and the
    warm-up's time."""
    model.eval()
    with torch.no_grad():
        t = time.perf_counter()
        model(x)
        first = time.perf_counter() - t
        best, dropped = timed(lambda: model(x), repeat, cold)
    return best, dropped, first


def section_disk(path: Path, ids: list[int], repeat: int, out: dict) -> None:
    import transformers

    from disco_ray.models import LlamaModel
    from workloads.checkpoint import Checkpoint

    weights = Checkpoint(path).weight_bytes()
    budget = weights // 3
    files = sorted(path.glob("*.safetensors"))
    drop_caches()
    bw, nbytes = disk_bandwidth(files)
    x = torch.tensor([ids])
    rows = []

    mem_s, _, _ = forward_time(transformers.LlamaForCausalLM.from_pretrained(path), x, repeat, cold=False)
    rows.append(("transformers, in memory (warm)", mem_s, "-"))

    with LlamaModel(str(path), capacity=budget, weights="disk") as m:
        m.prefill(ids)  # plans, and a first pass over the file
        disco_s, dropped = timed(lambda: m.prefill(ids), repeat, cold=True)
        prog = next(p for k, (_, p) in m._programs.items() if k[0] == "prefill")
        reads = [w["store"]["streamed"] for w in prog.statistics()["engine"]["workers"]]
    rows.append((f"disco-ray, weights from disk, arena {budget / 1e6:.0f} MB", disco_s, dropped))

    with tempfile.TemporaryDirectory(prefix="accel-offload-") as folder:
        model = transformers.LlamaForCausalLM.from_pretrained(
            path, device_map="auto", max_memory={"cpu": budget}, offload_folder=folder
        )
        acc_s, acc_dropped, setup = forward_time(model, x, repeat, cold=True)
        del model
    rows.append(
        (f"transformers + accelerate disk offload, max_memory {budget / 1e6:.0f} MB", acc_s, acc_dropped)
    )

    floor = max(mem_s, nbytes / bw / 1e9)
    print(
        f"\n== disk: prefill of {len(ids)} tokens, {weights / 1e9:.2f} GB of float32 weights, RAM budget a third =="
    )
    print(
        f"disk read (O_DIRECT, page cache dropped): {bw:.2f} GB/s over {nbytes / 1e9:.2f} GB -> {nbytes / bw / 1e9:.2f} s"
    )
    print("| run | prefill s | cold (page cache dropped) | vs max(compute, read) |")
    print("| --- | --- | --- | --- |")
    for name, s, cold in rows:
        c = "-" if cold == "-" else ("yes" if cold else "no (not allowed)")
        print(f"| {name} | {s:.3f} | {c} | {s / floor:.2f}x |")
    for g, r in enumerate(reads):
        print(
            f"disco-ray worker {g}: read {r['io_bytes'] / 1e9:.2f} GB in {r['read_s']:.2f} s ({r['read_gb_per_s']} GB/s), "
            f"{r['direct_reads']} O_DIRECT reads, {r['buffered_reads']} buffered"
        )
    print(
        f"disco-ray cold / max(compute {mem_s:.3f} s, read {nbytes / bw / 1e9:.3f} s) = {disco_s / floor:.2f}x "
        f"(goal <= 1.15x); accelerate / disco-ray = {acc_s / disco_s:.2f}x (goal >= 1.5x); "
        f"accelerate's first forward {setup:.1f} s"
    )
    out["disk"] = {
        "weights_bytes": weights,
        "budget_bytes": budget,
        "disk_gb_per_s": bw,
        "rows": [{"run": n, "prefill_s": s, "cold": c} for n, s, c in rows],
        "reads": reads,
        "accelerate_setup_s": setup,
    }


def section_elastic(path: Path, ids: list[int], new: int, out: dict) -> None:
    from disco_ray.models import LlamaModel
    from disco_ray.models.llama import capacity_bounds

    bounds = capacity_bounds(str(path), prompt=len(ids), new_tokens=new)
    roomy = bounds["roomy"][0]
    least = bounds["min"][0]
    print(f"\n== elastic: greedy decode after a {len(ids)}-token prompt, {new} new tokens ==")
    print(
        "| capacity | bytes per GPU | decode tok/s | reloaded per step MB | resize: request to memory free |"
    )
    print("| --- | --- | --- | --- | --- |")
    rows = []
    with LlamaModel(str(path), capacity=roomy) as m:
        m.run_generate(ids, new, stop_at_eos=False)  # warm-up at 100%
        first = None
        for share in (1.0, 0.5, 0.25):
            cap = max(least, int(roomy * share))
            r = m.resize(cap)
            m.run_generate(ids, 2, stop_at_eos=False)  # the plans at this capacity
            g = m.run_generate(ids, new, stop_at_eos=False)
            st = g.statistics()
            key = max(k for k in m._programs if k[0] == "decode")
            reloaded = m._programs[key][1].mg.stats.get("bytes_reloaded", 0)
            first = first or st["decode_tokens_per_s"]
            rows.append({"share": share, "capacity": cap, "tokens": g.tokens, **st, "free_s": r["free_s"]})
            print(
                f"| {share:.0%} | {cap / 1e6:.0f} MB | {st['decode_tokens_per_s']:.1f} | "
                f"{reloaded / 1e6:.1f} | {1e3 * r['free_s']:.1f} ms |"
            )
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"tokens the same at every capacity: {same}")
    out["elastic"] = {
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        "same_tokens": same,
    }


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, new=16, repeat=2)
    ap.add_argument("--only", default="disk,elastic")
    args = ap.parse_args(argv)
    path = checkpoint(Path(args.dir))
    ids = prompt_ids(args.prompt)
    print(f"checkpoint {path}; {torch.get_num_threads()} torch threads, torch {torch.__version__}, CPU only")
    out: dict = {}
    only = args.only.split(",")
    if "disk" in only:
        section_disk(path, ids, args.repeat, out)
    if "elastic" in only:
        section_elastic(path, ids, args.new, out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
