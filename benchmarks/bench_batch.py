"""Batched generation on this CPU: new tokens/s per batch, against transformers, and against the
policy's prediction (issue #24's Performance section).

    .venv/bin/python benchmarks/bench_batch.py [--dir /tmp/bench_llama] [--prompt 128] [--new 32]
        [--batches 1,4,16,64] [--engine local] [--repeat 2] [--json out.json]

On the 0.49 GB benchmark checkpoint (benchmarks/bench_llama_cpu.py makes it once), `batch` prompts
of --prompt random tokens each, --new new tokens per sequence (greedy, no stop at EOS):

(a) weights streamed from the checkpoint (`weights="disk"`: each step reads them from the file
    again) with an arena of a third of the weights: new tokens/s per batch, each batch at the
    micro-batches the policy search chooses for it (among those whose prefill plans too); the
    goal is batch 64 >= 20x batch 1;
(b) a roomy arena, the local engine: new tokens/s at batch 16 against transformers' batched
    `generate` of the same prompts (left-padded, greedy) in this process; the goal >= 0.8x;
(c) predicted against measured: each batch's decode-step plan of (a) simulated under a CPU
    profile: matmul FLOP/s measured here, and the load rate (the worker reading weights from the
    file), the `linear` kernels' bytes/s and the per-vertex cost read from batch 1's trace: batch 1
    is the calibration, the other batches are predictions. The policy chooses each batch's
    micro-batches beforehand under the profile of this machine's micro-benchmarks alone.

New tokens/s counts every new token of every sequence over the whole call's wall time (prefill
included, as FlexGen's generation throughput does); disco-ray's decode step is the median of its
decode runs, transformers' (wall(--new) - wall(1)) / (--new - 1). Best of --repeat after a warm-up
call (plans, weight reads). A benchmark: it measures and prints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_llama_cpu import SHAPE, checkpoint  # noqa: E402

from disco_ray.bench import policy  # noqa: E402
from disco_ray.bench.profiles import Profile  # noqa: E402
from disco_ray.graph.memgraph import MKind  # noqa: E402
from workloads.llm.batch import batch_decode_graph, batch_prefill_graph  # noqa: E402
from workloads.llm.checkpoint import Checkpoint  # noqa: E402

BLOCK = 64


def prompts(batch: int, n: int) -> list[list[int]]:
    """`batch` fixed random prompts of `n` token ids (ids 3.. : no special token)."""
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, SHAPE["vocab_size"], (batch, n), generator=g).tolist()


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


# ---- transformers ---------------------------------------------------------------------------------
def bench_transformers(path: Path, batch: list[list[int]], new: int, repeat: int) -> dict:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    n = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.int64)
    mask = torch.zeros(len(batch), n, dtype=torch.int64)
    for i, p in enumerate(batch):  # left-padded, as batched generation needs
        ids[i, n - len(p) :] = torch.tensor(p)
        mask[i, n - len(p) :] = 1

    def gen(k: int):
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0
        )

    with torch.no_grad():
        gen(2)  # warm-up
        wall = best_of(lambda: gen(new), repeat)
        one = best_of(lambda: gen(1), repeat)
        out = gen(new)
    return {
        "wall_s": wall,
        "tokens_per_s": len(batch) * new / wall,
        "step_s": (wall - one) / (new - 1),
        "tokens": out[:, n:].tolist(),
    }


# ---- disco-ray ------------------------------------------------------------------------------------
def bench_disco(model, batch: list[list[int]], new: int, repeat: int, micro: int) -> dict:
    """Best of `repeat` calls after a warm-up; the step is the median decode run of the best call."""

    def gen():
        t = time.perf_counter()
        out = model.run_generate_batch(batch, new, micro=micro, stop_at_eos=False)
        return time.perf_counter() - t, out

    gen()  # warm-up: the plans of this batch's shape, the weights read
    wall, out = min((gen() for _ in range(repeat)), key=lambda r: r[0])
    st = out.statistics()
    return {
        "wall_s": wall,
        "tokens_per_s": st["new_tokens"] / wall,
        "step_s": st["step_ms"]["median"] / 1e3,
        "prefill_s": st["prefill_s"],
        "tokens": [list(s.new_ids) for s in out.sequences],
        "statistics": {k: v for k, v in st.items() if k != "step_ms"}
        | {"step_ms_median": st["step_ms"]["median"]},
    }


# ---- the CPU as a device profile --------------------------------------------------------------------
def cpu_profile(path: Path, streams: int) -> Profile:
    """Rates measured here: fp32 matmul FLOP/s, memory bytes/s (a matrix-vector product reads the
    matrix once), file read bytes/s of a weight (page-cached), copy bytes/s; launch fitted later."""
    from disco_ray.graph import sources

    a, b = (
        torch.randn(512, SHAPE["hidden_size"]),
        torch.randn(SHAPE["hidden_size"], SHAPE["intermediate_size"]),
    )
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1] / best_of(lambda: a @ b, 5)
    m, v = torch.randn(8192, 8192), torch.randn(8192)
    mem = m.numel() * 4 / best_of(lambda: m @ v, 5)
    ck = Checkpoint(path)
    name, (_, shape, _) = max(ck.tensors.items(), key=lambda kv: kv[1][1][0] * kv[1][1][-1])
    src, dst = ck.source(name), torch.empty(shape)
    # the worker copies what it reads into the arena: the read alone maps the file, copies nothing
    read = dst.numel() * 4 / best_of(lambda: dst.copy_(sources.read(src, shape, "float32")), 3)
    big = torch.randn(16 << 20)
    to = torch.empty_like(big)
    copy = big.numel() * 4 / best_of(lambda: to.copy_(big), 5)
    return Profile(
        "cpu (measured)",
        {"float32": flops},
        mem,
        read,
        copy,
        copy,
        1 << 40,
        launch=0.0,
        streams=streams,
        ahead=0,  # the cpu backend's
        overlap=True,  # the streams' kernels share the cores, as the measured durations did
    )


def fit_profile(prof: Profile, tg, mg, records) -> tuple[Profile, dict]:
    """`prof` with the rates a decode step's trace (`records`, of plan `mg`) shows: load bytes/s
    (inputs and reloads: the worker reads the weights from the file), memory bytes/s of the
    `linear` kernels (at batch 1 they read their weight once), the per-vertex cost (median of the
    elementwise kernels). The matmul FLOP/s stay `prof`'s (the trace's products are too small)."""
    by = {v.id: v for v in mg.vertices}
    load_b = load_s = lin_b = lin_s = 0.0
    small = []
    for recs in records:
        for vid, _, t0, t1 in recs:
            v, dt = by[vid], (t1 - t0) / 1e9
            if v.kind in (MKind.INPUT, MKind.RELOAD):
                load_b, load_s = load_b + v.out.nbytes, load_s + dt
            elif v.kind is MKind.KERNEL and tg[v.value].op == "linear":
                lin_b, lin_s = lin_b + v.out.nbytes + sum(r.loc.nbytes for r in v.ins), lin_s + dt
            elif v.kind is MKind.KERNEL and tg[v.value].op in ("add", "mul", "silu"):
                small.append(dt)
    launch = statistics.median(small) if small else 0.0
    fitted = prof.with_(h2d=load_b / load_s, hbm=lin_b / lin_s, launch=launch)
    return fitted, {"h2d": fitted.h2d, "hbm": fitted.hbm, "launch_s": launch, "flops": prof.flops["float32"]}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    from disco_ray.models.graphs import capacity_bounds

    path = checkpoint(Path(args.dir))
    ck = Checkpoint(path)
    weights = ck.weight_bytes()
    batches = [int(b) for b in args.batches.split(",")]
    micros = [int(m) for m in args.micros.split(",")]
    skip = set(args.skip.split(","))
    blocks = (args.prompt + args.new - 2) // BLOCK + 1  # the last step's cache blocks
    third = max(capacity_bounds(str(path), prompt=args.prompt, new_tokens=args.new).min[0], weights // 3)
    print(
        f"checkpoint {path}: {weights / 1e9:.2f} GB float32; prompt {args.prompt}, {args.new} new tokens; "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, CPU only (shared machine)"
    )
    out: dict = {"weights_bytes": weights, "prompt": args.prompt, "new": args.new, "capacity_third": third}
    prof, chosen = _policy_micros(path, ck, args, third, blocks, batches, micros)
    rows_a: dict = {}
    traces: dict = {}  # batch -> (TaskGraph, MemGraph, records) of its last decode step
    if "a" not in skip:
        rows_a, traces = _part_a(path, args, third, blocks, batches, chosen, out)
    if "b" not in skip:
        _part_b(path, args, out)
    if "c" not in skip and rows_a:
        _part_c(prof, rows_a, traces, chosen, out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/bench_llama", help="where the checkpoint is (made if missing)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--micros", default="1,2,4", help="micro-batches the policy may choose per batch")
    ap.add_argument("--engine", default="local", help="(a)'s engine: local or ray")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip", default="", help="parts to skip, e.g. 'b' or 'a,c'")
    ap.add_argument("--json", help="write the figures here too")
    return ap.parse_args(argv)


def _policy_micros(
    path: Path, ck: Checkpoint, args, third: int, blocks: int, batches: list[int], micros: list[int]
):
    """The CPU profile, and the policy's micro-batches per batch at (a)'s capacity under it."""
    prof = cpu_profile(path, streams=5)
    print(
        f"cpu profile: matmul {prof.flops['float32'] / 1e9:.0f} GFLOP/s, memory {prof.hbm / 1e9:.1f} GB/s, "
        f"file reads {prof.h2d / 1e9:.1f} GB/s, copies {prof.d2h / 1e9:.1f} GB/s"
    )

    def make(b: int, m: int):
        return batch_decode_graph(ck, 1, b, blocks, BLOCK, dtype="float32", micro=m).taskgraph

    def make_prefill(b: int, m: int):  # as LlamaModel builds it (tile 4 blocks)
        pb = -(-args.prompt // BLOCK)
        return batch_prefill_graph(ck, 1, b, pb, BLOCK, dtype="float32", micro=m, tile=4 * BLOCK).taskgraph

    chosen = {}
    for b in batches:
        got = policy.search(make, third, cost=prof, batches=(b,), micros=micros, prefill=make_prefill)
        chosen[b] = got.micro
    print("policy's micro-batches per batch at a third of the weights:", chosen)
    return prof, chosen


def _part_a(path: Path, args, third: int, blocks: int, batches: list[int], chosen: dict, out: dict):
    """(a) a third of the weights, weights='disk': new tokens/s per batch; the rows and each
    batch's last decode step (TaskGraph, MemGraph, records)."""
    from disco_ray.models import LlamaModel

    rows_a = {}
    traces = {}  # batch -> (TaskGraph, MemGraph, records) of its last decode step
    print(f"\n(a) weights='disk', arena {third / 1e6:.0f} MB (a third of the weights), {args.engine} engine")
    with LlamaModel(str(path), capacity=third, engine=args.engine, weights="disk") as model:
        for b in batches:
            r = bench_disco(model, prompts(b, args.prompt), args.new, args.repeat, chosen[b])
            rows_a[b] = r
            # its decode steps sample on the device: the plan key ends with the stop ids per row
            key = next(k for k in model._programs if k[:4] == ("batch_decode", b, blocks, chosen[b]))
            mgraph, prog = model._programs[key]
            traces[b] = (mgraph.taskgraph, prog.mg, prog.last_records)
            print(
                f"  batch {b:>3} micro {chosen[b]}: {r['tokens_per_s']:8.1f} new tokens/s (prefill "
                f"{r['prefill_s']:.2f} s), decode step {1e3 * r['step_s']:.0f} ms = {b / r['step_s']:.1f} "
                "new tokens/s in decode",
                flush=True,
            )
    if 1 in rows_a and max(batches) in rows_a:
        hi, lo = rows_a[max(batches)], rows_a[1]
        ratio = hi["tokens_per_s"] / lo["tokens_per_s"]
        decode = (max(batches) / hi["step_s"]) / (1 / lo["step_s"])
        print(
            f"  batch {max(batches)} / batch 1: {ratio:.1f}x over the whole call, {decode:.1f}x in decode "
            "(goal >= 20x)"
        )
        out["a_ratio"], out["a_decode_ratio"] = ratio, decode
    out["a"] = {str(b): {k: v for k, v in r.items() if k != "tokens"} for b, r in rows_a.items()}
    return rows_a, traces


def _part_b(path: Path, args, out: dict) -> None:
    """(b) a roomy arena, batch 16, against transformers' batched generate."""
    from disco_ray.models import LlamaModel
    from disco_ray.models.graphs import capacity_bounds

    b = 16
    batch = prompts(b, args.prompt)
    roomy = capacity_bounds(str(path), prompt=args.prompt, new_tokens=args.new).roomy[0] * b
    print(f"\n(b) roomy arena, local engine, batch {b}, against transformers' batched generate")
    hf = bench_transformers(path, batch, args.new, args.repeat)
    with LlamaModel(str(path), capacity=roomy, engine="local") as model:
        r = bench_disco(model, batch, args.new, args.repeat, 1)
    same = r["tokens"] == hf["tokens"]
    ratio = r["tokens_per_s"] / hf["tokens_per_s"]
    print(f"  transformers: {hf['tokens_per_s']:8.1f} new tokens/s, step {1e3 * hf['step_s']:.0f} ms")
    print(f"  disco-ray:    {r['tokens_per_s']:8.1f} new tokens/s, step {1e3 * r['step_s']:.0f} ms")
    print(f"  ratio {ratio:.2f}x (goal >= 0.8x); greedy tokens {'the same' if same else 'DIFFER'}")
    out["b"] = {
        "transformers": {k: v for k, v in hf.items() if k != "tokens"},
        "disco": {k: v for k, v in r.items() if k != "tokens"},
        "ratio": ratio,
        "same_tokens": same,
    }


def _part_c(prof, rows_a: dict, traces: dict, chosen: dict, out: dict) -> None:
    """(c) the decode step predicted (rates fitted on batch 1's trace) against measured."""
    print("\n(c) decode step: predicted (simulated, cpu profile) against measured, weights='disk', a third")
    if 1 not in rows_a:
        raise SystemExit("(c) fits the rates on batch 1's trace: keep 1 in --batches")
    fitted, fit = fit_profile(prof, *traces[1])
    print(
        f"  fitted on batch 1's last decode step: loads {fitted.h2d / 1e9:.2f} GB/s, linear kernels "
        f"{fitted.hbm / 1e9:.1f} GB/s, per vertex {1e6 * fitted.launch:.0f} us; matmul {prof.flops['float32'] / 1e9:.0f} GFLOP/s"
    )
    print(
        f"  {'batch':>5} {'micro':>5} {'pred. ms':>9} {'meas. ms':>9} {'pred. tok/s':>11} {'meas. tok/s':>11}"
    )
    out["c"] = {"fitted": fit}
    for b, r in rows_a.items():
        step = policy.predict(*traces[b][:2], fitted)
        print(
            f"  {b:>5} {chosen[b]:>5} {1e3 * step:>9.0f} {1e3 * r['step_s']:>9.0f} {b / step:>11.1f} {b / r['step_s']:>11.1f}"
        )
        out["c"][str(b)] = {"predicted_step_s": step, "measured_step_s": r["step_s"]}


if __name__ == "__main__":
    sys.exit(main())
