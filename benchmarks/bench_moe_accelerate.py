"""Mixtral decode under one memory limit: disco-ray against transformers + accelerate disk offload.

    PYTHONPATH=. python benchmarks/bench_moe_accelerate.py [--dir DIR] [--new 8] [--fraction 0.25]
        [--limit-fraction 0.6] [--tools routed,all,accelerate]

The checkpoint is `benchmarks/bench_moe.py`'s (random Mixtral, 8 experts, 4 layers, about 1.1 GB,
made once in `--dir`). Each tool runs in its own child process inside its own cgroup-v1 memory
cgroup (`/sys/fs/cgroup/memory/<name>`, root needed) whose `memory.limit_in_bytes` is
`--limit-fraction` of the weight bytes for every tool; the limit counts the page cache the child
fills, and the checkpoint's cached pages are dropped (`posix_fadvise DONTNEED`) before each child,
so no tool reads the weights from memory charged to someone else. The cgroup is removed after.

- "routed" / "all": disco-ray, local engine, one cpu-backend GPU whose arena is `--fraction` of the
  weights, weights streamed from the checkpoint (O_DIRECT) at each load: experts loaded only when
  routed, or every expert at every step (`bench_moe.run`).
- "accelerate": `MixtralForCausalLM.from_pretrained(device_map="auto", max_memory={"cpu": the
  arena's bytes}, offload_folder=..., offload_state_dict=True)`: what does not fit the same weight
  budget is offloaded to disk and read back (accelerate's hooks) at each forward; greedy `generate`.

Printed per tool: decode tokens/s (the median step), the weight bytes read per decode step, the
cgroup's peak memory and fail count, and whether its tokens equal the first tool's (greedy).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CGROUPS = Path("/sys/fs/cgroup/memory")
TOOLS = ("routed", "all", "accelerate")


def usage(message: str) -> None:
    """Exit 2 with one line naming what is wrong."""
    print(f"bench_moe_accelerate: {message}", file=sys.stderr)
    sys.exit(2)


def drop_cached(directory: Path) -> None:
    """Drop the page cache of the files in `directory` (their pages charged to no child yet)."""
    for f in sorted(directory.rglob("*")):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_stat(group: Path) -> dict:
    """The cgroup's peak usage, fail count and OOM kills."""
    oom = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    return {
        "limit": int((group / "memory.limit_in_bytes").read_text()),
        "peak": int((group / "memory.max_usage_in_bytes").read_text()),
        "failcnt": int((group / "memory.failcnt").read_text()),
        "oom_kills": int(oom.get("oom_kill", 0)),
    }


def run_limited(tool: str, args: argparse.Namespace, limit: int) -> dict:
    """Run `tool` in a child process inside a fresh memory cgroup of `limit` bytes."""
    if not (CGROUPS / "cgroup.procs").exists() or not os.access(CGROUPS, os.W_OK):
        usage(f"{CGROUPS} is not a writable cgroup-v1 memory controller (run as root)")
    group = CGROUPS / f"disco_bench_{tool}_{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        drop_cached(Path(args.dir))
        cmd = [sys.executable, __file__, "--child", tool, "--dir", args.dir, "--new", str(args.new)]
        cmd += ["--fraction", str(args.fraction), "--offload", args.offload]

        def enter() -> None:  # in the child before exec: everything it starts inherits the cgroup
            (group / "cgroup.procs").write_text(str(os.getpid()))

        t = time.perf_counter()
        proc = subprocess.run(cmd, preexec_fn=enter, capture_output=True, text=True)
        wall = time.perf_counter() - t
        stat = read_stat(group)
    finally:
        for _ in range(50):  # the child's exit can lag its cgroup's emptying
            if not (group / "cgroup.procs").read_text().strip():
                break
            time.sleep(0.1)
        group.rmdir()
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        why = "killed by the OOM killer" if stat["oom_kills"] else f"exit {proc.returncode}: {tail}"
        return {"setting": tool, "failed": why, "cgroup": stat}
    out = json.loads(lines[-1])
    out.update(cgroup=stat, wall_s=round(wall, 1))
    return out


def run_accelerate(path: Path, fraction: float, new: int, offload: Path) -> dict:
    """transformers + accelerate disk offload with the arena's bytes as its cpu weight budget."""
    import torch
    import transformers
    from bench_moe import PROMPT
    from transformers.generation.streamers import BaseStreamer

    from workloads.llm.checkpoint import Checkpoint

    weights = Checkpoint(path).weight_bytes()
    budget = int(weights * fraction)
    shutil.rmtree(offload, ignore_errors=True)
    t = time.perf_counter()
    model = transformers.MixtralForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        device_map="auto",
        max_memory={"cpu": budget},
        offload_folder=str(offload),
        offload_state_dict=True,
    ).eval()
    load_s = time.perf_counter() - t
    model.generation_config.eos_token_id = None  # as disco-ray's stop_at_eos=False: all `new` tokens
    # a parameter left on the meta device is offloaded: read from the offload folder at each forward
    on_disk = [(n, p.nbytes) for n, p in model.named_parameters() if p.device.type == "meta"]
    stamps: list[float] = []

    class Stamps(BaseStreamer):
        def put(self, value):  # the prompt, then each new token as it is made
            stamps.append(time.perf_counter())

        def end(self):
            pass

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=new, do_sample=False, streamer=Stamps(), pad_token_id=0
        )
    steps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # each decode step
    step_s = statistics.median(steps)
    return {
        "setting": "accelerate",
        "weights": weights,
        "capacity": budget,
        "tokens": out[0, len(PROMPT) :].tolist(),
        "decode_tokens_per_s": round(1 / step_s, 3),
        "decode_step_s_median": round(step_s, 4),
        "bytes_read_per_step": sum(b for _, b in on_disk),
        "expert_bytes_read_per_step": sum(b for n, b in on_disk if ".experts." in n),
        "placement": sorted({str(d) for d in model.hf_device_map.values()}),
        "prefill_s": round(stamps[1] - stamps[0], 3),
        "load_s": round(load_s, 3),
    }


def child(args: argparse.Namespace) -> None:
    """One tool, inside its cgroup: print its result as one JSON line."""
    from bench_moe import run

    path = Path(args.dir)
    if args.child == "accelerate":
        result = run_accelerate(path, args.fraction, args.new, Path(args.offload))
    else:
        result = run(path, args.fraction, args.new, routed=args.child == "routed")
        per = result["expert_bytes_loaded_per_step"]
        result["expert_bytes_read_per_step"] = int(statistics.median(per)) if per else 0
    print(json.dumps(result))


def report(results: list[dict]) -> None:
    """One line per tool, then the JSON."""
    from disco_ray.graph.sizes import format_size

    first = next((r["tokens"] for r in results if "tokens" in r), None)
    for r in results:
        cg = r["cgroup"]
        mem = f"cgroup peak {format_size(cg['peak'])} of {format_size(cg['limit'])}, failcnt {cg['failcnt']}"
        if "failed" in r:
            print(f"{r['setting']:>10}: FAILED ({r['failed']}), {mem}")
            continue
        print(
            f"{r['setting']:>10}: decode {r['decode_tokens_per_s']:.2f} tokens/s (median step "
            f"{r['decode_step_s_median'] * 1e3:.0f} ms), expert bytes read per step "
            f"{format_size(r['expert_bytes_read_per_step'])}, {mem}, "
            f"tokens {'equal' if r['tokens'] == first else 'DIFFER'} {r['tokens']}"
        )
    print(json.dumps(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/disco_bench_moe", help="where the checkpoint is (made once)")
    ap.add_argument("--new", type=int, default=8, help="new tokens (decode steps + 1)")
    ap.add_argument("--fraction", type=float, default=0.25, help="arena (and accelerate cpu) / weights")
    ap.add_argument("--limit-fraction", type=float, default=0.6, help="cgroup memory limit / weights")
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated, of " + ", ".join(TOOLS))
    ap.add_argument("--offload", default="/tmp/disco_bench_moe_offload", help="accelerate's folder")
    ap.add_argument("--child", choices=TOOLS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    tools = args.tools.split(",")
    if bad := [t for t in tools if t not in TOOLS]:
        usage(f"--tools: unknown {', '.join(bad)} (known: {', '.join(TOOLS)})")
    from bench_moe import checkpoint

    from workloads.llm.checkpoint import Checkpoint

    path = checkpoint(Path(args.dir))
    limit = int(Checkpoint(path).weight_bytes() * args.limit_fraction)
    try:
        report([run_limited(t, args, limit) for t in tools])
    finally:
        shutil.rmtree(args.offload, ignore_errors=True)


if __name__ == "__main__":
    main()
