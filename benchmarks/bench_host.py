"""Host cost per vertex of the cuda backend's threads, on a stand-in device or on the GPU.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_host.py [--repeat 5] [--streams 1,5] [--device null|cuda]

Runs one worker's Executor with the cuda backend on a stand-in device, every kernel run by the
same torch code on tiny CPU tensors, so the device is never the bottleneck and the time is what
the host spends: the kernels' own host time plus the runtime's (loop, wakers, counters, events).
`--device strict` (the default): the stand-in of tests/fake_cuda.py, whose work runs later on
each stream's thread and whose events, waits and locks are Python objects: it adds a hand-over
to a stream thread per launch and its own bookkeeping, which on a GPU are the driver's C calls.
`--device null` (benchmarks/null_cuda.py): a device infinitely faster than the host, every
CUDA call one Python call that does nothing and work run at launch: the host-bound regime of a
decode step on a GPU, where what is measured is the runtime's own cost. It also runs an older
checkout's runtime: `PYTHONPATH=OLD python benchmarks/bench_host.py --device null`. `--device
cuda`: the real GPU (an older checkout's runtime too), tiny kernels of a few microseconds each, so
the host still sets the pace but every CUDA call (events, waits, launches through torch) is the
driver's; `serial` is then the same kernels run one after another on the GPU. The graph is
llama_prefill with the 7B run's vertex structure (4 layers, 8 sequence tiles: 512 kernels, as
`--capacity 2GiB` at seq 4096 tile 512 on the H100) and tiny tensors (dim 64, 4 heads).
`serial` is the same kernels run one after another in one thread (disco_ray.graph.reference.evaluate):
the floor. The outputs are checked against the workload's torch reference. With strict and null,
the figures are host-CPU figures of this machine; no GPU is involved. OMP_NUM_THREADS=1
keeps torch's CPU thread pool out of it (on a GPU, kernels do not use it).
`cpu us/vertex` is the process's CPU time (all its threads) per vertex, kernels included: on a
loaded machine it moves less than the wall time. `py calls` is the runtime's Python function calls per vertex, on every thread, in one more run
under a profiler: those of actors/, disco_ray/ (not the kernels) and of threading, contextlib and
queue when the runtime calls them; not the stand-in's own (on a GPU those are torch's C++ calls). Unlike the times, it does
not depend on the load of the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import threading
import time

import torch

from actors.executor import Executor
from actors.options import WorkerConfig
from disco_ray.bench.report import check_outputs
from disco_ray.graph.reference import evaluate
from planner import build_memgraph
from workloads.llama import llama_prefill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per setting; the best counts")
    ap.add_argument("--streams", default="1,5", help="comma-separated stream counts")
    ap.add_argument("--ahead", default="0,4", help="comma-separated launch-ahead depths")
    ap.add_argument(
        "--no-kernels",
        action="store_true",
        help="kernels and copies as no-ops: the host cost of the runtime and the stand-in alone "
        "(outputs not checked)",
    )
    ap.add_argument(
        "--device",
        choices=("strict", "null", "cuda"),
        default="strict",
        help="strict: tests/fake_cuda.py (work later, on stream threads); null: benchmarks/null_cuda.py "
        "(a device infinitely faster than the host); cuda: the GPU",
    )
    ap.add_argument(
        "--held",
        action="store_true",
        help="after the first run, hand in only the activations: the weights and rotary tables "
        "stay in the arena and their loads are skipped, as in a decode step",
    )
    args = ap.parse_args(argv)
    if args.device == "null":
        _null_cuda().install()
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench_host.py: --device cuda needs a GPU (torch sees no CUDA device)", file=sys.stderr)
            return 2
    else:
        from tests import fake_cuda

        fake_cuda.install()
    from actors.backends.cuda import CudaBackend

    w = llama_prefill(
        preset="7b", layers=4, gpus=1, seq=64, tile=8, dim=64, heads=4, ffn=128, dtype="float32"
    )
    tg = w.taskgraph
    mg = build_memgraph(tg, 1 << 30)
    again = {k: v for k, v in w.inputs.items() if k.startswith("h0_")} if args.held else w.inputs
    n = len(mg.vertices)
    on = "cuda" if args.device == "cuda" else "cpu"
    evaluate(tg, w.inputs, on)
    serial = min(_timed(_serial, tg, w.inputs, on) for _ in range(args.repeat))
    if args.no_kernels:
        serial = 0.0
        CudaBackend.kernel = CudaBackend.copy = lambda self, *a: None  # type: ignore[method-assign]
    print(f"llama_prefill structure: {n} vertices; serial kernels {serial * 1e3:.1f} ms")
    print(
        "streams  ahead  wall ms  us/vertex  over serial us/vertex  launch us (mean)  cpu us/vertex  py calls  "
        "loads skipped"
    )
    for streams in map(int, args.streams.split(",")):
        for ahead in map(int, args.ahead.split(",")):
            be = CudaBackend()
            ex = Executor(0, mg, tg, WorkerConfig(streams=streams, ahead=ahead), backend=be)
            try:
                best = cpu = float("inf")
                for i in range(args.repeat + 1):  # the first run makes the events
                    c = time.process_time()
                    best = min(best, _timed(_run, ex, again if i else w.inputs))
                    cpu = min(cpu, time.process_time() - c)
                host = be.statistics()["host"]
                skipped = ex.statistics()["loads_skipped"]  # in the last run
                outs = {k: ex.output(k, mg.outputs[k]) for k in tg.outputs}
                got = check_outputs(outs, w.reference(w.inputs))
                if not got["ok"] and not args.no_kernels:
                    raise SystemExit(f"bench_host: output {got['output']} is off by {got['max_rel_err']:.2g}")
            finally:
                ex.close()
            config = WorkerConfig(streams=streams, ahead=ahead)
            calls = _calls(lambda c=config: Executor(0, mg, tg, c, backend=CudaBackend()), w.inputs, again)
            print(
                f"{streams:7d}  {ahead:5d}  {best * 1e3:7.1f}  {best / n * 1e6:9.1f}  "
                f"{(best - serial) / n * 1e6:21.1f}  {host['launch_us_mean']:16.1f}  {cpu / n * 1e6:13.1f}  {calls / n:8.1f}  {skipped:13d}"
            )
    return 0


def _serial(tg, inputs, device: str) -> None:
    """The kernels one after another in one thread, on `device` (all of them done on return)."""
    evaluate(tg, inputs, device)
    if device == "cuda":
        torch.cuda.synchronize()


def _run(ex: Executor, inputs) -> None:
    ex.begin(inputs)
    ex.dispatch(list(ex.core.mine))
    if not ex.wait(timeout=300) or ex.error is not None:
        raise SystemExit(f"bench_host: run failed: {ex.error or 'timed out'}")


RUNTIME = ("/actors/", "/disco_ray/")
STDLIB = ("/threading.py", "/contextlib.py", "/queue.py")  # counted when the runtime calls them


def _calls(make, inputs, again) -> int:
    """The runtime's Python calls in one run (the second, on `again`) of a new executor, every
    thread."""
    count = [0]

    def prof(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if any(d in f for d in STDLIB):  # a lock's or a queue's, when the runtime called it
                count[0] += _by_runtime(frame.f_back)
            elif any(d in f for d in RUNTIME) and "/kernels" not in f:
                count[0] += 1

    threading.setprofile(prof)  # the executor's threads start with it
    try:
        ex = make()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    try:
        _run(ex, inputs)  # makes the events
        count[0] = 0
        sys.setprofile(prof)
        try:
            _run(ex, again)
        finally:
            sys.setprofile(None)
        return count[0]
    finally:
        ex.close()


def _null_cuda():
    """benchmarks/null_cuda.py, beside this file whatever checkout PYTHONPATH names first."""
    path = pathlib.Path(__file__).with_name("null_cuda.py")
    spec = importlib.util.spec_from_file_location("null_cuda", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _by_runtime(frame) -> bool:
    """Whether the first caller of `frame` outside the standard library is the runtime's code."""
    while frame is not None and any(d in frame.f_code.co_filename for d in STDLIB):
        frame = frame.f_back
    return frame is not None and any(d in frame.f_code.co_filename for d in RUNTIME)


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
