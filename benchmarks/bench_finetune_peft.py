"""A LoRA step of disco-ray against peft with gradient checkpointing, interleaved on one CPU.

    .venv/bin/python benchmarks/bench_finetune_peft.py [--dir /tmp/bench_llama] [--seq 512]
        [--batch 1] [--steps 5] [--warmup 1] [--threads 2] [--block 512] [--streams 1]
        [--runs peft-ckpt,peft,local,ray] [--json out.json]

The checkpoint is bench_llama_cpu.py's (made once: 8 layers, hidden 1024, 0.49 GB float32), the
adapter rank 16 (alpha 32) on q, k, v, gate, up and down, the optimizer AdamW (lr 1e-4, no
weight decay), the batch --batch x --seq random token ids (seed 0), the same for every run:

- `peft-ckpt`: transformers + peft, `model.gradient_checkpointing_enable()` (the fair baseline:
  disco-ray recomputes each layer's forward in the backward too);
- `peft`: the same without checkpointing (every activation kept), for reference;
- `local`, `ray`: disco-ray's `LoraTrainer` on one logical GPU (cpu backend) with a roomy arena
  (the plan moves nothing), on the local or the ray engine.

Each run lives in a process of its own (its peak RSS is its own) with `torch.set_num_threads
(--threads)` (the ray engine's worker process too). After --warmup steps each, the runs take one
step in turn, --steps rounds, the order rotating every round, so that the box's load (printed,
with each step's time) hits them alike. Printed: the median seconds per step, its ratio to
`peft-ckpt`, the CPU seconds per step (the processes' user + system time, children included),
peak RSS (of the driver's process: "-" for the ray engine, whose kernels run in its worker) and
the first step's loss (the same model and data; B starts at zero, so equal to 4 digits). A run
`local:B:S` or `ray:B:S` is disco-ray with tiles of B tokens and S streams (default: --block,
--streams, which default to LoraTrainer's own defaults for 512 tokens). A benchmark: it measures
and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
RUNS = {
    "peft-ckpt": "transformers + peft, gradient checkpointing",
    "peft": "transformers + peft, every activation kept",
    "local": "disco-ray LoraTrainer, local engine, roomy arena",
    "ray": "disco-ray LoraTrainer, ray engine, roomy arena",
}


def _cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _peft_step(path: str, checkpointing: bool, tokens):
    import peft
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()  # the embedding is frozen: checkpoints need a grad input
    model.config.use_cache = False
    cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS), lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    pm.train()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)

    def step() -> float:
        loss = pm(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step, lambda: None


def _disco_step(path: str, engine: str, tokens, block: int, streams: int):
    from disco_ray.models.finetune import LoraTrainer
    from planner import roomy_capacity
    from workloads.llm.checkpoint import Checkpoint
    from workloads.llm.train import LoraSpec, OptimSpec, train_graph

    spec, optim = LoraSpec(16, 32.0, TARGETS), OptimSpec(lr=1e-4)
    tg = train_graph(Checkpoint(path), 1, *tokens.shape, block, spec, optim).taskgraph
    cap = roomy_capacity(tg)[0]
    tr = LoraTrainer(path, capacity=cap, lora=spec, optim=optim, engine=engine, block=block, streams=streams)
    return lambda: tr.step(tokens), tr.close


def serve(kind: str, path: str, batch: int, seq: int, threads: int, block: int, streams: int) -> int:
    """One run's process: a step per line read on stdin, its figures as a JSON line on stdout."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tokens = torch.randint(0, 32000, (batch, seq), generator=torch.Generator().manual_seed(0))
    if kind.startswith("peft"):
        step, close = _peft_step(path, kind == "peft-ckpt", tokens)
    else:
        step, close = _disco_step(path, kind, tokens, block, streams)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t, c = time.perf_counter(), _cpu_s()
        loss = step()
        s, cpu = time.perf_counter() - t, _cpu_s() - c
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"s": s, "cpu_s": cpu, "loss": loss, "rss_mb": rss}), flush=True)
    close()
    return 0


def _ask(p: subprocess.Popen) -> dict:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("step\n")
    p.stdin.flush()
    return _answer(p)


def _answer(p: subprocess.Popen) -> dict:
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"a run's process ended early (exit {p.wait()})")


def main(args) -> int:
    import torch
    from bench_llama_cpu import checkpoint

    path = str(checkpoint(Path(args.dir)))
    kinds = args.runs.split(",")
    bad = [k for k in kinds if _run_of(k, args) is None]
    if bad:
        print(
            f"--runs: unknown run {bad[0]!r} (known: {', '.join(RUNS)}, local:B:S, ray:B:S)", file=sys.stderr
        )
        return 2
    print(f"checkpoint {path}; batch {args.batch} x {args.seq} tokens; LoRA rank 16 on {','.join(TARGETS)}")
    print(
        f"torch {torch.__version__}, {args.threads} torch threads per run, {os.cpu_count()} CPUs; "
        f"disco-ray block {args.block}, {args.streams} stream(s); load average {os.getloadavg()}"
    )
    procs = {}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in kinds:
        kind, block, streams = _run_of(k, args) or (k, 0, 0)
        cmd = [sys.executable, __file__, "_serve", kind, path, str(args.batch), str(args.seq)]
        cmd += [str(args.threads), str(block), str(streams)]
        procs[k] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        _answer(procs[k])
    figs: dict[str, list[dict]] = {k: [] for k in kinds}
    try:
        for k in kinds:
            figs[k] += [dict(_ask(procs[k]), warmup=True) for _ in range(args.warmup)]
        for r in range(args.steps):
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            got = {k: _ask(procs[k]) for k in order}
            for k in kinds:
                figs[k].append(got[k])
            line = ", ".join(f"{k} {got[k]['s']:.2f} s" for k in kinds)
            print(f"round {r + 1}: {line}; load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.close()
            p.wait()
    _table(kinds, figs, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "steps": figs}, indent=1))
    return 0


def _run_of(k: str, args) -> tuple[str, int, int] | None:
    """(kind, block, streams) of a --runs entry: a name of RUNS, or local:B:S / ray:B:S (tiles of
    B tokens, S streams); None if it is neither."""
    kind, *rest = k.split(":")
    if kind not in RUNS or (rest and (kind.startswith("peft") or len(rest) != 2)):
        return None
    if not all(x.isdigit() and int(x) > 0 for x in rest):
        return None
    return (kind, int(rest[0]), int(rest[1])) if rest else (kind, args.block, args.streams)


def _name(k: str, args) -> str:
    kind, block, streams = _run_of(k, args) or (k, 0, 0)
    return RUNS[kind] + ("" if kind.startswith("peft") else f", tiles of {block}, {streams} stream(s)")


def _table(kinds: list[str], figs: dict[str, list[dict]], args) -> None:
    med = {k: statistics.median(f["s"] for f in figs[k] if not f.get("warmup")) for k in kinds}
    base = med.get("peft-ckpt")
    print("| run | s / step (median) | vs peft-ckpt | CPU s / step | peak RSS MB | loss of step 1 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in kinds:
        steps = [f for f in figs[k] if not f.get("warmup")]
        cpu = statistics.median(f["cpu_s"] for f in steps)
        ratio = f"{med[k] / base:.2f}x" if base else "-"
        rss = max(f["rss_mb"] for f in figs[k])
        if k.startswith("ray"):  # its kernels run in the worker's process, not the driver's
            cpu_s = rss_s = "-"
        else:
            cpu_s, rss_s = f"{cpu:.2f}", f"{rss:.0f}"
        print(f"| {_name(k, args)} | {med[k]:.2f} | {ratio} | {cpu_s} | {rss_s} | {figs[k][0]['loss']:.4f} |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    if sys.argv[1:2] == ["_serve"]:
        k, p, b, s, th, bl, st = sys.argv[2:9]
        raise SystemExit(serve(k, p, int(b), int(s), int(th), int(bl), int(st)))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/bench_llama")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="measured steps per run, interleaved")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per run")
    ap.add_argument("--block", type=int, default=512, help="disco-ray's row tile, in tokens")
    ap.add_argument("--streams", type=int, default=1, help="disco-ray's streams per worker")
    ap.add_argument("--runs", default="peft-ckpt,peft,local,ray")
    ap.add_argument("--json")
    raise SystemExit(main(ap.parse_args()))
