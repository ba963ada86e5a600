"""Predicts FlexGen's headline setting with the simulator and the batch policy search (no GPU).

The setting (FlexGen, Sheng et al. 2023, section 6; the figures as issue #24 quotes them): OPT-30B
on one NVIDIA T4 (16 GB), weights in host RAM, prompt 512 tokens, 32 new tokens per sequence,
generation throughput FlexGen 7.32 new tokens/s, Hugging Face accelerate 0.62, DeepSpeed
ZeRO-Inference 0.60. disco-ray runs LLaMA-family models, so the model here is a LLaMA-style one of
OPT-30B's size, described by a config and no weights (`Checkpoint.from_config`): hidden 7168, 48
layers, 56 heads (multi-head attention), OPT's vocabulary of 50272 with tied embeddings as OPT,
fp16, and a SwiGLU width of 19200, so its MLP holds about OPT's 8 * hidden^2 per layer (3 * 7168 *
19200) and the model ~30.0 B parameters.

What is predicted (THIS IS A PREDICTION, NOT A MEASUREMENT):
- a decode step: the decode graph of `batch` sequences in `micro` micro-batches at the cache length
  of the last step (blocks of 64: positions 512-542 are all in block 8, so all 31 steps use the
  graph of 9 blocks), planned by the planner at the T4's memory less `--reserve` (kernel
  workspace), simulated under the `t4` profile (disco_ray.bench.profiles): every weight and every
  KV cache block the step reads crosses PCIe from the host store (~12 GB/s), the block it writes
  goes back; to stay within minutes the graph is built for 2 and 4 layers and the step time
  extrapolated linearly to 48 (as benchmarks/predict_llama.py does; `--full` builds all 48);
- the policy (disco_ray.bench.policy.choose) over the candidates: the (batch, micro) of the most
  predicted new tokens/s per decode step among those that plan within the arena and whose weights
  and KV cache fit the host RAM (`--host-memory`, FlexGen's machine: 208 GB);
- the prefill of `batch` prompts: their batched prefill graph (one tile of 512 rows per prompt,
  the prompts' micro-batches sharing each layer's weight load as the decode step's do) planned
  and simulated the same way, at the micro-batch count that makes it fastest among those that
  plan;
- generation throughput as FlexGen counts it: batch * 32 / (prefill + 31 decode steps) (the
  prefill gives each sequence its first new token).
Not modelled: FlexGen's CPU attention and 4-bit compression (it computes attention on the CPU to
keep the KV cache off PCIe; here the cache crosses PCIe each step), the disk tier (everything
fits the host RAM here), the host's own memory bandwidth, Python and launch overheads beyond the
profile's 10 us per vertex.

    PYTHONPATH=. python benchmarks/predict_flexgen.py                 # the table
    PYTHONPATH=. python benchmarks/predict_flexgen.py --json out.json --batches 1,64,144,192
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from disco_ray.bench import policy, profiles
from disco_ray.bench.policy import Candidate
from workloads.llm.batch import batch_decode_graph, batch_prefill_graph
from workloads.llm.checkpoint import Checkpoint

CONFIG = dict(
    model_type="llama",
    vocab_size=50272,  # OPT's
    hidden_size=7168,
    intermediate_size=19200,  # 3 * 7168 * 19200 ~ OPT-30B's 8 * 7168^2 MLP parameters per layer
    num_hidden_layers=48,
    num_attention_heads=56,
    tie_word_embeddings=True,  # as OPT
    max_position_embeddings=2048,
    dtype="float16",
)
PROMPT, NEW, BLOCK = 512, 32, 64
PAPER = {"FlexGen": 7.32, "Hugging Face accelerate": 0.62, "DeepSpeed ZeRO-Inference": 0.60}


def checkpoint(layers: int) -> Checkpoint:
    return Checkpoint.from_config(dict(CONFIG, num_hidden_layers=layers))


def step_graph(layers: int):
    """make_graph(batch, micro) of one decode step of a `layers`-deep model at the last cache length."""
    ck, blocks = checkpoint(layers), (PROMPT + NEW - 2) // BLOCK + 1

    def make(batch: int, micro: int):
        return batch_decode_graph(ck, 1, batch, blocks, BLOCK, dtype="float16", micro=micro).taskgraph

    return make


def extrapolate(a: float, b: float, da: int, db: int, depth: int) -> float:
    """Linear in depth from the values at depths da and db: the fill and drain, then a steady per-layer cost."""
    return a + (b - a) * (depth - da) / (db - da)


def prefill(batch: int, micros: list[int], layers: tuple[int, ...], depth: int, cap: int, prof) -> tuple:
    """(seconds, micro) of the fastest prefill of `batch` prompts among the micro-batch counts that
    plan within `cap`, extrapolated to `depth` layers; (None, reason) when none plans."""

    def make(n: int):
        ck = checkpoint(n)
        return lambda b, m: (
            batch_prefill_graph(
                ck, 1, b, PROMPT // BLOCK, BLOCK, dtype="float16", micro=m, tile=PROMPT
            ).taskgraph
        )

    per = [
        {
            c.micro: c
            for c in policy.search(make(n), cap, cost=prof, batches=(batch,), micros=micros).candidates
        }
        for n in layers
    ]
    times = {
        m: a.step_s if len(layers) == 1 else extrapolate(a.step_s, per[-1][m].step_s, *layers, depth)
        for m, a in per[0].items()
        if a.fits and per[-1][m].fits
    }
    if not times:
        return None, next(iter(per[0].values())).excluded
    m = min(times, key=lambda k: (times[k], k))
    return times[m], m


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    prof = profiles.t4
    depth = CONFIG["num_hidden_layers"]
    short = (depth,) if args.full else tuple(int(x) for x in args.short.split(","))
    cap = int(prof.memory * (1 - args.reserve))
    full = checkpoint(depth)
    weights = full.weight_bytes()
    batches = [int(x) for x in args.batches.split(",")]
    micros = [int(x) for x in args.micros.split(",")]
    print(
        f"PREDICTION (simulated, not measured): LLaMA-style model of OPT-30B's size, {full.parameters() / 1e9:.2f} B "
        f"parameters, {weights / 1e9:.1f} GB fp16, weights in host RAM ({args.host_memory / 1e9:.0f} GB)"
    )
    print(
        f"t4 profile: {prof.memory / 2**30:.0f} GiB (arena {cap / 2**30:.1f} GiB), fp16 {prof.flops['float16'] / 1e12:.0f} "
        f"TFLOP/s x {prof.efficiency}, GDDR6 {prof.hbm / 1e9:.0f} GB/s, PCIe {prof.h2d / 1e9:.0f} GB/s each way; "
        f"prompt {PROMPT}, {NEW} new tokens; depths {short} -> {depth}"
    )
    t0 = time.perf_counter()
    cands, held = _candidates(short, depth, cap, prof, batches, micros, args.host_memory)
    best = policy.choose(cands)
    search_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    prefills = {c.batch: prefill(c.batch, micros, short, depth, cap, prof) for c in cands if c.fits}
    prefill_s = time.perf_counter() - t0

    def generation(c: Candidate) -> tuple[float, float]:
        pre = prefills[c.batch][0]
        return pre, (c.batch * NEW / (pre + (NEW - 1) * c.step_s)) if pre else 0.0

    print(
        f"\npolicy search ({search_s:.0f} s, prefills {prefill_s:.0f} s): decode step per candidate, the chosen marked *"
    )
    print(
        f"{'':1} {'batch':>6} {'micro':>5} {'step s':>8} {'decode tok/s':>12} {'H2D GB/step':>11} {'host GB':>8} {'prefill s':>9} {'gen tok/s':>9}  note"
    )
    rows = _table(cands, best, held, generation)
    chosen = next(c for c in cands if (c.batch, c.micro) == (best.batch, best.micro))
    pre, gen = generation(chosen)
    print(
        f"\npredicted: batch {best.batch} in {best.micro} micro-batch(es): decode step {best.step_s:.2f} s "
        f"({best.tokens_per_s:.2f} new tokens/s), prefill {pre:.0f} s in {prefills[best.batch][1]} micro-batch(es), "
        f"generation throughput {gen:.2f} new tokens/s"
    )
    for name, tps in PAPER.items():
        print(f"  paper (FlexGen section 6): {name} {tps} new tokens/s")
    if args.json:
        doc = _doc(args, full, cap, short, prefills, search_s, prefill_s, rows, best, pre, gen)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,32,64,96,128,144,160,192,224,256")
    ap.add_argument("--micros", default="1,2,4,8")
    ap.add_argument(
        "--reserve", type=float, default=0.1, help="fraction of the T4's memory kept for kernel workspace"
    )
    ap.add_argument(
        "--host-memory", default=208e9, type=float, help="host RAM bytes (FlexGen's T4 machine: 208 GB)"
    )
    ap.add_argument("--short", default="2,4", help="the two depths to extrapolate from")
    ap.add_argument("--full", action="store_true", help="build all 48 layers instead of extrapolating")
    ap.add_argument("--json", metavar="PATH", help="write the table and the assumptions as JSON")
    return ap.parse_args(argv)


def _candidates(
    short: tuple[int, ...],
    depth: int,
    cap: int,
    prof,
    batches: list[int],
    micros: list[int],
    host_memory: float,
):
    """Every (batch, micro) of the policy search at the `short` depths, extrapolated to `depth`
    (a candidate whose weights and KV cache exceed the host RAM excluded); and per fitting
    candidate, the host bytes of its step's inputs at full depth."""
    per_depth = [
        {
            (c.batch, c.micro): c
            for c in policy.search(step_graph(n), cap, cost=prof, batches=batches, micros=micros).candidates
        }
        for n in short
    ]
    held = {}  # (batch, micro) -> host bytes of the step's inputs at full depth (weights, KV cache)
    cands = []
    for key, a in per_depth[0].items():
        b = per_depth[-1][key]
        if not (a.fits and b.fits):
            cands.append(a if not a.fits else b)
            continue
        if len(short) == 1:
            step, loaded = a.step_s, a.loaded
        else:
            step = extrapolate(a.step_s, b.step_s, *short, depth)
            loaded = round(extrapolate(a.loaded, b.loaded, *short, depth))
        ha, hb = (policy.host_bytes(step_graph(n)(*key))[0] for n in (short[0], short[-1]))
        held[key] = round(ha if len(short) == 1 else extrapolate(ha, hb, *short, depth))
        if held[key] > host_memory:
            why = f"weights and KV cache need {held[key] / 1e9:.0f} GB of host RAM, more than {host_memory / 1e9:.0f}"
            cands.append(Candidate(*key, excluded=why))
        else:
            cands.append(Candidate(*key, step, loaded))
    return cands, held


def _table(cands: list[Candidate], best: Candidate, held: dict, generation) -> list[dict]:
    """The table's rows printed, one per candidate (the chosen marked *); returned for the JSON."""
    rows = []
    for c in cands:
        mark = "*" if (c.batch, c.micro) == (best.batch, best.micro) else ""
        if c.fits:
            pre, gen = generation(c)
            host = held[(c.batch, c.micro)] / 1e9
            print(
                f"{mark:1} {c.batch:>6} {c.micro:>5} {c.step_s:>8.3f} {c.tokens_per_s:>12.3f} {c.loaded / 1e9:>11.1f} {host:>8.0f} {pre:>9.1f} {gen:>9.3f}"
            )
            rows.append(
                dict(
                    batch=c.batch,
                    micro=c.micro,
                    step_s=c.step_s,
                    decode_tokens_per_s=c.tokens_per_s,
                    h2d_bytes=c.loaded,
                    host_bytes=held[(c.batch, c.micro)],
                    prefill_s=pre,
                    generation_tokens_per_s=gen,
                )
            )
        else:
            print(
                f"{mark:1} {c.batch:>6} {c.micro:>5} {'-':>8} {'-':>12} {'-':>11} {'-':>8} {'-':>9} {'-':>9}  {c.excluded}"
            )
            rows.append(dict(batch=c.batch, micro=c.micro, excluded=c.excluded))
    return rows


def _doc(
    args,
    full: Checkpoint,
    cap: int,
    short,
    prefills: dict,
    search_s: float,
    prefill_s: float,
    rows,
    best,
    pre,
    gen,
) -> dict:
    """The JSON document: the table, the chosen candidate and the assumptions."""
    return dict(
        prediction=True,
        config=CONFIG,
        parameters=full.parameters(),
        profile="t4",
        arena_bytes=cap,
        host_memory=args.host_memory,
        prompt=PROMPT,
        new_tokens=NEW,
        depths=list(short),
        prefill_micro={str(b): m for b, (_, m) in prefills.items()},
        search_s=search_s,
        prefill_search_s=prefill_s,
        candidates=rows,
        chosen=dict(
            batch=best.batch,
            micro=best.micro,
            step_s=best.step_s,
            decode_tokens_per_s=best.tokens_per_s,
            prefill_s=pre,
            generation_tokens_per_s=gen,
        ),
        paper=PAPER,
    )


if __name__ == "__main__":
    sys.exit(main())
