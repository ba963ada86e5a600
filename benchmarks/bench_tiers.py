"""Memory tiers: one workload at a tight GPU capacity with the host store unbounded, then with a
small host budget (offloads beyond it go to disk), and the disk bandwidth the spill files reach.

    PYTHONPATH=. python benchmarks/bench_tiers.py [--fraction 0.02] [--host-budget 2MiB] [--disk DIR]

The workload is llama_prefill on one GPU (4 layers, seq 1024, dim 512, float32: 232 MiB of
tensors); the arena gets `--fraction` of them, so activations are offloaded and reloaded. Each
setting runs `--warmup` untimed runs, then `--repeat` timed ones (the best counts); outputs are
checked against the workload's torch reference. Printed per setting: the makespan, bytes
offloaded and reloaded per tier (host, disk), the peak bytes per tier (gpu arena, host store,
spill file), and the disk I/O the workers did (bytes, seconds of file I/O, GB/s). First, a probe
of the spill file's directory: sequential O_DIRECT writes and reads of `--probe` bytes in blocks
of the workload's largest disk offload, through the same `actors.tiers.spill.SpillFile` code.

On the cpu backend the "GPU" arena is host memory and copies are memcpy: the figures are CPU
figures of this machine (2 shared cores), what the issue's point 4 (CPU-only use) is about.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

import torch

from actors.tiers.spill import SpillFile
from disco_ray.bench.report import check_outputs
from disco_ray.driver.api import compile
from disco_ray.graph.memgraph import DISK
from disco_ray.graph.sizes import format_size, parse_size
from planner import tight_capacity
from workloads.llama import llama_prefill

PARAMS = {"layers": 4, "gpus": 1, "seq": 1024, "dim": 512, "heads": 8, "ffn": 1376, "tile": 128}


def probe(directory: str | None, total: int, block: int) -> dict:
    """Sequential writes then reads of `total` bytes in `block`-byte I/Os of a spill file."""
    alloc = lambda n, host: torch.zeros(n, dtype=torch.uint8)  # noqa: E731
    f = SpillFile(directory, 0, total, block, alloc, buffers=1)
    try:
        src = torch.randint(0, 255, (block,), dtype=torch.uint8)
        n = total // block
        first = 0.0
        for _ in range(2):  # the first pass writes a fresh file (extents converted), then rewrites
            t = time.perf_counter()
            for i in range(n):
                f.write(i * block, src)
            f.flush()  # the writes go behind, on the file's writer thread
            w = time.perf_counter() - t
            first = first or w
        dst = torch.empty(block, dtype=torch.uint8)
        t = time.perf_counter()
        for i in range(n):
            f.read(i * block, dst, lambda d, s: d.copy_(s))
        r = time.perf_counter() - t
        return {
            "direct": f.direct,
            "first_write_gb_s": n * block / first / 1e9,
            "write_gb_s": n * block / w / 1e9,
            "read_gb_s": n * block / r / 1e9,
        }
    finally:
        f.close()


def run_setting(w, cap, host, args) -> dict:
    """The best of `--repeat` runs at arena `cap` (None: everything fits) and host budget `host`."""
    ref = w.reference(w.inputs)
    with compile(
        w.taskgraph, cap, host_capacity=host, engine=args.engine, disk_dir=args.disk, streams=args.streams
    ) as prog:
        best = None
        for r in range(args.warmup + args.repeat):
            res = prog.run(w.inputs, details=True, timeout=600)
            c = check_outputs(res.outputs, ref)
            if not c["ok"]:
                raise SystemExit(f"outputs differ from the reference: {c}")
            if r >= args.warmup and (best is None or res.summary["makespan_s"] < best["makespan_s"]):
                best = res.summary
        st = prog.mg.stats
        spilled = [v.out.nbytes for v in prog.mg if v.out.device == DISK]
    assert best is not None
    return {"summary": best, "plan": st, "block": max(spilled, default=0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fraction", type=float, default=0.02, help="arena as a fraction of the tensor bytes")
    ap.add_argument("--host-budget", default="2MiB", help="the small host-store budget (default 2MiB)")
    ap.add_argument("--disk", help="directory of the spill files (default: a temporary one)")
    ap.add_argument("--engine", choices=["local", "ray"], default="local")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--probe", default="256MiB", help="bytes the disk probe writes and reads")
    args = ap.parse_args(argv)
    tmp = None
    if args.disk is None:
        tmp = args.disk = tempfile.mkdtemp(prefix="bench-tiers-")
    try:
        w = llama_prefill(**PARAMS)
        tg = w.taskgraph
        cap = tight_capacity(tg, args.fraction)
        total = sum(v.nbytes for v in tg)
        print(
            f"llama_prefill {PARAMS}: {format_size(total)} of tensors, arena {format_size(cap[0])} "
            f"({args.fraction:g}), cpu backend, {args.engine} engine, spill files in {args.disk}"
        )
        budget = parse_size(args.host_budget)
        rows = []
        settings = [
            ("in memory (no offloads)", None, None),
            ("host unbounded", cap, None),
            (f"host {format_size(budget)} + disk", cap, budget),
        ]
        for name, c, host in settings:
            r = run_setting(w, c, host, args)
            rows.append((name, r))
            print(f"  {name}: done", file=sys.stderr)
        block = max(r["block"] for _, r in rows) or 1 << 20  # the largest disk offload
        p = probe(args.disk, parse_size(args.probe), -(-block // 4096) * 4096)
        print(
            f"disk probe ({'O_DIRECT' if p['direct'] else 'buffered'}, {format_size(block)} blocks): "
            f"write {p['write_gb_s']:.2f} GB/s (a fresh file: {p['first_write_gb_s']:.2f} GB/s), "
            f"read {p['read_gb_s']:.2f} GB/s"
        )
        print()
        _print_table(rows)
        print()
        _print_host_ram(rows)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _print_table(rows: list[tuple[str, dict]]) -> None:
    """A markdown row per setting: makespan, bytes per tier, peaks, disk I/O."""
    print(
        "| setting | makespan | offloaded host / disk | reloaded host / disk | peak gpu / host / disk "
        "| disk write | disk read | disk lanes busy |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows:
        s, st = r["summary"], r["plan"]
        off_d, rel_d = st["bytes_offloaded_disk"], st["bytes_reloaded_disk"]
        d = s.get("disk")

        def io(way: str, secs: str, rate: str, d=d) -> str:
            if not d or not d[f"bytes_{way}"]:
                return "-"
            return f"{format_size(d[f'bytes_{way}'])} in {d[secs] * 1e3:.0f} ms ({d[rate]:.2f} GB/s)"

        print(
            f"| {name} | {s['makespan_s'] * 1e3:.0f} ms "
            f"| {format_size(st['bytes_offloaded'] - off_d)} / {format_size(off_d)} "
            f"| {format_size(st['bytes_reloaded'] - rel_d)} / {format_size(rel_d)} "
            f"| {format_size(max(st['peak_gpu_bytes']))} / {format_size(max(st['peak_host_bytes']))} / "
            f"{format_size(max(st['peak_disk_bytes']))} "
            f"| {io('written', 'write_s', 'write_gb_per_s')} | {io('read', 'read_s', 'read_gb_per_s')} "
            f"| {max(g.get('busy_disk', 0) for g in s['gpus']):.0%} |"
        )


def _print_host_ram(rows: list[tuple[str, dict]]) -> None:
    """A line per setting: the host RAM the tiers took, read-ahead hits, compute busy."""
    for name, r in rows:
        d = r["summary"].get("disk")
        if d:
            w0 = d["workers"][0]
            ra = w0["read_ahead"]
            io_bytes = w0["buffer_bytes"] + ra["staging_bytes"]
            store = max(r["plan"]["peak_host_bytes"])
            print(
                f"{name}: host RAM for the tiers {format_size(store + io_bytes)}: the host store's peak "
                f"{format_size(store)} + I/O buffers {format_size(w0['buffer_bytes'])} (bounce, writes "
                f"behind) and {format_size(ra['staging_bytes'])} (read-ahead staging); "
                f"reloads read ahead {ra['hits']}, read by the reload itself {ra['misses']}; "
                f"compute busy {r['summary']['gpus'][0]['busy_compute']:.0%}"
            )
        else:
            print(
                f"{name}: host RAM for the tiers {format_size(max(r['plan']['peak_host_bytes']))} (the host "
                f"store's peak); compute busy {r['summary']['gpus'][0]['busy_compute']:.0%}"
            )
    print(
        "(reloaded host includes weights reloaded from the caller's copy; disk I/O counts whole "
        "4 KiB blocks and only the seconds of file I/O; disk lanes busy: the share of the makespan "
        "with a disk offload or reload running, beside compute; CPU figures)"
    )


if __name__ == "__main__":
    sys.exit(main())
