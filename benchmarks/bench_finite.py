"""What the weights' finite check costs (`disco_ray.graph.sources.check_finite`), on this CPU.

    PYTHONPATH=. python benchmarks/bench_finite.py [--dir /tmp/bench_llama] [--repeat 3]

The checkpoint is benchmarks/bench_llama_cpu.py's (8 layers, hidden 1024, float32: 0.49 GB; made
once). Printed, best of --repeat:
- the check against `isfinite().all()` and a copy, over every tensor of the checkpoint;
- `--weights host`: every block read as a worker reads it (`sources.read`), then copied once (its
  first load into the arena), without and with the check;
- each of `--weights host` and `disk` through `LlamaModel` (local engine, capacity 200MiB, a
  16-token prompt): the seconds spent in the check during the first generation (load, prefill,
  one decode step) and during 15 later decode steps, against those steps' median.
A benchmark: it measures and prints; nothing here is a test.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_batch import best_of as best  # noqa: E402
from benchmarks.bench_llama_cpu import checkpoint  # noqa: E402
from disco_ray.graph import sources  # noqa: E402
from workloads.llm.checkpoint import Checkpoint  # noqa: E402


def kernels(ck: Checkpoint, repeat: int) -> None:
    from safetensors.torch import load_file

    w = [t for f in sorted({f for f, _, _ in ck.tensors.values()}) for t in load_file(f).values()]
    gb = sum(t.numel() * t.element_size() for t in w) / 1e9
    for name, fn in (
        ("sum (the check)", lambda t: math.isfinite(float(t.sum(dtype=torch.float32)))),
        ("isfinite().all()", lambda t: bool(torch.isfinite(t).all())),
        ("copy", lambda t: torch.empty_like(t).copy_(t)),
    ):
        s = best(lambda fn=fn: [fn(t) for t in w], repeat)
        print(f"{name:18s} {s * 1e3:7.1f} ms for {gb:.2f} GB ({gb / s:.1f} GB/s)")


def host_reads(ck: Checkpoint, repeat: int) -> None:
    for finite in (False, True):

        def read_and_copy(finite=finite):
            for name, (f, shape, _) in ck.tensors.items():
                b = sources.read(sources.Source(f, name, (), finite), shape, "float32")
                torch.empty_like(b).copy_(b)

        s = best(read_and_copy, repeat)
        print(f"host read + first copy, check {'on ' if finite else 'off'}: {s * 1e3:.0f} ms")


def in_model(path: str, weights: str) -> None:
    from disco_ray.models import LlamaModel

    spent = [0.0, 0]
    real = sources.check_finite

    def timed(t, what, stored=None):
        t0 = time.perf_counter()
        try:
            return real(t, what, stored)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    sources.check_finite = timed
    ids = list(range(1, 17))
    try:
        with LlamaModel(path, capacity="200MiB", engine="local", weights=weights) as m:
            t = time.perf_counter()
            m.run_generate(ids, 2, stop_at_eos=False)
            first, at_first = time.perf_counter() - t, tuple(spent)
            steps = [s for _ in range(3) for s in m.run_generate(ids, 6, stop_at_eos=False).decode_s]
    finally:
        sources.check_finite = real
    print(
        f"--weights {weights}: first generation {first:.2f} s, the check {at_first[0] * 1e3:.0f} ms "
        f"({at_first[1]} blocks); {len(steps)} decode steps, median {statistics.median(steps) * 1e3:.0f} "
        f"ms, the check {(spent[0] - at_first[0]) * 1e3:.1f} ms ({spent[1] - at_first[1]} blocks)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/bench_llama", help="where the checkpoint is (made if missing)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    path = checkpoint(Path(args.dir))
    ck = Checkpoint(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: the kernels' own rates
    kernels(ck, args.repeat)
    host_reads(ck, args.repeat)
    torch.set_num_threads(threads)
    for weights in ("host", "disk"):
        in_model(str(path), weights)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
