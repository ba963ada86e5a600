"""`disco-ray generate`: generation with a Hugging Face LLaMA checkpoint, one prompt or a JSONL file.

    disco-ray generate MODEL_DIR --prompt-ids 1,2,3 --max-new-tokens 20 --gpus 2 --capacity 64MiB
        [--dtype float32|float16|bfloat16] [--engine ray|local] [--backend cpu|cuda] [--block 64]
        [--logits OUT.npz] [--json] [--prompt TEXT] [--ignore-eos] [--address auto] ...
    disco-ray generate MODEL_DIR --prompts IN.jsonl --batch 16 --max-new-tokens 32 --capacity 1GiB
        [--out OUT.jsonl] [--json] [--stats STATS.json] [--progress]
        [--temperature T] [--top-k K] [--top-p P] [--seed S] [--do-sample | --greedy] [--stop-ids 2,13]

One prompt: prints the new token ids, comma-separated, on one line (and, with --prompt, the
decoded text on the next). `--logits` writes the prompt's logits as the array `logits` [prompt
length, vocab] (float32); `--json` prints one JSON object instead: the tokens, prefill seconds,
decode tokens/s, planning seconds and bytes each plan offloads and reloads. `--max-new-tokens 0`
only prefills. `--prompt TEXT` needs the `tokenizers` package and the checkpoint's tokenizer.json.

`--prompts`: one JSON request per line in, one result per line out as sequences finish, the
prompts run `--batch` at a time (`disco_ray.cli.prompts` says the formats). `--json` writes the
run's statistics as one JSON object on stderr (stdout carries the results unless `--out`), or to
`--stats`. Sampling: greedy unless `--do-sample`, or any of `--temperature`, `--top-k`, `--top-p`
without `--greedy`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from disco_ray.graph.errors import UsageError

from .app import (
    add_capacity_args,
    add_tier_args,
    capacity_of,
    check_writable,
    command,
    positive_int,
    seconds_arg,
    seed_arg,
)
from .run import add_model_run_args, model_run_kwargs


def token_ids(text: str) -> list[int]:
    """argparse type for `--prompt-ids 1,2,3`."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad token ids {text!r} (want integers: 1,2,3)") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def batch_arg(text: str) -> int | str:
    """argparse type for `--batch N|auto`: prompts per batch, >= 1, or "auto" (the policy search)."""
    return "auto" if text == "auto" else positive_int(text)


def finite_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"want a finite number, got {text[:40]!r}")
    return x


@command(
    "generate",
    help="generation with a Hugging Face LLaMA checkpoint: one prompt, or a JSONL file in batches",
    description="Load MODEL_DIR onto GPUS workers with CAPACITY arena bytes each, prefill the "
    "prompt and decode (greedy unless sampling is asked for) with a KV cache the workers keep. "
    "One prompt: prints the new token ids. --prompts FILE.jsonl: runs the prompts --batch at a "
    "time and writes a JSON line per sequence as it finishes (to --out, or stdout).",
)
def add_generate(p) -> None:
    p.add_argument("model", metavar="MODEL_DIR", help="config.json + model.safetensors (or shards)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt-ids", type=token_ids, metavar="IDS", help="prompt token ids, e.g. 1,2,3")
    what.add_argument("--prompt", metavar="TEXT", help="prompt text (needs tokenizers and tokenizer.json)")
    what.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help='one request per line: {"ids": [...]} or {"text": "..."}, optional "max_new_tokens" '
        'and "stop_ids"; the results go to --out (default stdout), a JSON line per sequence as it finishes',
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="0: prefill only (one prompt); with --prompts, for lines without their own",
    )
    p.add_argument(
        "--batch",
        type=batch_arg,
        metavar="N|auto",
        help="--prompts: prompts per batch (default 1); auto: the batch of the most predicted new "
        "tokens/s at the capacity (disco_ray.bench.policy), chosen again when --budget-file changes "
        "the capacity. Either way each step's micro-batches are the plans' choice (the fewest bytes "
        "moved at the current capacity, chosen again after a capacity change)",
    )
    p.add_argument(
        "--policy-profile",
        metavar="NAME",
        help="--batch auto: the simulator's device profile (h100, a100, p100, t4; cpu: this machine's "
        "CPU measured at start, the default with --backend cpu; h100 with cuda)",
    )
    p.add_argument(
        "--out",
        metavar="FILE.jsonl",
        help="--prompts: write the results here (via FILE.jsonl.partial, renamed when all are done)",
    )
    p.add_argument(
        "--stats",
        metavar="FILE.json",
        help="--prompts: write the run's statistics here (as --json does on stderr)",
    )
    p.add_argument(
        "--progress",
        action="store_true",
        help="--prompts: a progress bar on stderr (sequences done, new tokens/s) even when it is no terminal",
    )
    smp = p.add_argument_group("sampling (greedy unless --do-sample, or --temperature/--top-k/--top-p)")
    smp.add_argument(
        "--temperature", type=finite_float, metavar="T", help="> 0; the logits are divided by it"
    )
    smp.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (0: off)")
    smp.add_argument(
        "--top-p", type=finite_float, metavar="P", help="in (0, 1]: keep the fewest tokens holding P"
    )
    smp.add_argument("--seed", type=seed_arg, metavar="S", help="sampling seed (default: a random one)")
    how = smp.add_mutually_exclusive_group()
    how.add_argument("--do-sample", action="store_true", help="sample (temperature 1 unless given)")
    how.add_argument("--greedy", action="store_true", help="argmax, whatever the other sampling options")
    smp.add_argument(
        "--stop-ids",
        type=token_ids,
        metavar="IDS",
        help="token ids that end a sequence, beside the end-of-sequence ones (e.g. 2,13)",
    )
    p.add_argument(
        "--gpus", type=int, default=1, metavar="G", help="GPUs to split the model over (default 1)"
    )
    add_capacity_args(p)
    add_tier_args(p)  # --host-capacity, --disk
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: the checkpoint's")
    p.add_argument("--block", type=int, default=64, metavar="N", help="KV cache block, in tokens (64)")
    p.add_argument("--tile", type=int, metavar="N", help="prefill row tile, a multiple of --block (4 blocks)")
    p.add_argument("--logits", metavar="OUT.npz", help="write the prompt's logits as array 'logits'")
    p.add_argument(
        "--json",
        action="store_true",
        help="one prompt: print one JSON object with the tokens and statistics; --prompts: the run's "
        "statistics as one JSON object on stderr (stdout carries the results unless --out)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--timeout", type=seconds_arg, metavar="S", help="give up a run after S seconds")
    p.add_argument(
        "--budget-file",
        metavar="FILE",
        help="a file holding the arena bytes per GPU (e.g. 4GiB), re-read between decode steps: "
        "the run frees or grows its arenas to follow it (elastic capacity)",
    )
    add_model_run_args(p)  # --weights, the engine's and the cluster's options


def _tokenizer(model: str, flag: str = "--prompt"):
    path = Path(model) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(f"{flag} needs the tokenizers package (pip install tokenizers)") from None
    if not path.exists():
        raise UsageError(f"{flag} needs {path}, which is missing (give token ids)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise UsageError(f"{path}: not a tokenizer file ({e})") from None


_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed"}


def sampling_of(args, vocab: int):
    """The run's `SamplingParams` from the options (checked against the vocabulary): sampling
    when asked (`--do-sample`) or when a sampling option is given without `--greedy`."""
    from disco_ray.models.sampling import SamplingParams

    opts = (("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p))
    given = {k: v for k, v in opts if v is not None}
    params = SamplingParams(
        do_sample=args.do_sample or (bool(given) and not args.greedy),
        seed=args.seed,
        stop_ids=tuple(args.stop_ids or ()),
        **given,
    )
    try:
        params.validate(vocab)
    except UsageError as e:
        field, _, rest = str(e).partition(" ")
        flag = _FLAGS.get(field)
        raise UsageError(f"{flag} {rest}" if flag else f"--stop-ids: {e}") from None
    return params


def _capacity(args):
    """The arena bytes per GPU and the budget file to follow (None), checked."""
    capacity = capacity_of(args, args.gpus)
    budget = None
    if args.budget_file:
        from disco_ray.driver.elastic import BudgetFile

        budget = BudgetFile(args.budget_file)
        if capacity is None:
            capacity = budget.budget.capacity
    if capacity is None:
        raise UsageError("--capacity is required: the arena bytes of each GPU, e.g. 64MiB")
    return capacity, budget


def _vocab(model: str) -> int:
    """The vocabulary size from the checkpoint's config (its headers only: no weight is read)."""
    from workloads.llm.checkpoint import Checkpoint

    return Checkpoint(model).config.vocab


def _prompt_ids(args, vocab: int) -> tuple[list[int], Any]:
    """The one prompt's ids (and the tokenizer of --prompt, else None), checked against the vocabulary."""
    tok = _tokenizer(args.model) if args.prompt is not None else None
    ids = tok.encode(args.prompt).ids if tok is not None else args.prompt_ids
    flag = "--prompt" if tok is not None else "--prompt-ids"
    if not ids:
        raise UsageError(f"{flag}: empty prompt (the text tokenizes to no ids)")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"{flag}: token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    return ids, tok


def cmd_generate(args) -> int:
    if args.prompts is not None:
        return generate_file(args)
    for flag, value in (
        ("--batch", args.batch),
        ("--out", args.out),
        ("--stats", args.stats),
        ("--policy-profile", args.policy_profile),
    ):
        if value is not None:
            raise UsageError(f"{flag} takes --prompts (one prompt prints its tokens on stdout)")
    if args.progress:
        raise UsageError("--progress takes --prompts")
    if args.max_new_tokens is None:
        raise UsageError("--max-new-tokens is required with --prompt-ids or --prompt")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    chosen = (
        args.do_sample
        or args.stop_ids
        or any(v is not None for v in (args.temperature, args.top_k, args.top_p))
    )
    if chosen:
        sampling_of(args, _vocab(args.model))  # checked even when --max-new-tokens 0 samples nothing
        if args.max_new_tokens:
            return generate_sampled(args)
    return generate_one(args)


def generate_one(args) -> int:
    """One prompt, greedy: `LlamaModel.run_generate`."""
    capacity, budget = _capacity(args)
    if args.logits:
        out = Path(args.logits)
        if out.suffix != ".npz":
            raise UsageError(f"--logits {args.logits}: the logits are written as .npz")
        if not os.access(out.parent if str(out.parent) else ".", os.W_OK):
            raise UsageError(f"--logits {args.logits}: its directory is not writable")
    ids, tok = _prompt_ids(args, _vocab(args.model))
    with _open_model(args, capacity) as model:
        model.watch(budget)
        gen = model.run_generate(
            ids,
            args.max_new_tokens,
            stop_at_eos=not args.ignore_eos,
            prefill_logits=bool(args.logits),
            timeout=args.timeout,
        )
        stats = model.statistics()
    if args.logits:
        from .npz import save_npz

        assert gen.prefill_logits is not None  # asked for
        save_npz(args.logits, {"logits": gen.prefill_logits.float()})
    if args.json:
        doc = {
            **gen.statistics(),
            "prompt_tokens": len(ids),
            **_model_stats(args, stats),
        }
        if tok is not None:
            doc["text"] = tok.decode(gen.tokens)
        print(json.dumps(doc))
    else:
        print(",".join(str(t) for t in gen.tokens))
        if tok is not None:
            print(tok.decode(gen.tokens))
        s = gen.statistics()
        rate = s["decode_tokens_per_s"]
        print(
            f"prefill {len(ids)} tokens in {s['prompt_prefill_s']:.3f} s; "
            f"{s['decode_steps']} decode steps"
            + (f" at {rate:.1f} tokens/s" if rate else "")
            + f"; planning {s['planning_s']:.3f} s; stopped: {s['stopped']}",
            file=sys.stderr,
        )
    return 0


def _model_stats(args, stats: dict) -> dict:
    return {
        "plans": stats["plans"],
        "weight_bytes": stats["weight_bytes"],
        "gpus": args.gpus,
        "engine": args.engine,
        "backend": args.backend,
        "dtype": stats["dtype"],
        "resizes": stats["resizes"],
        "clamped_plans": stats["clamped_plans"],
    }


def _open_model(args, capacity):
    from disco_ray.models import LlamaModel

    kw = model_run_kwargs(args, args.gpus)
    return LlamaModel(
        args.model,
        gpus=args.gpus,
        capacity=capacity,
        dtype=args.dtype,
        block=args.block,
        tile=args.tile,
        **kw,
    )


def generate_sampled(args) -> int:
    """One prompt with sampling or --stop-ids: a batch of one (`LlamaModel.run_generate_batch`),
    printed as `generate_one` prints."""
    if args.logits:
        raise UsageError(
            "--logits comes with greedy generation: leave out the sampling options and --stop-ids"
        )
    capacity, budget = _capacity(args)
    vocab = _vocab(args.model)
    params = sampling_of(args, vocab).with_seed()
    ids, tok = _prompt_ids(args, vocab)
    with _open_model(args, capacity) as model:
        model.watch(budget)
        gen = model.run_generate_batch(
            [ids], args.max_new_tokens, sampling=params, stop_at_eos=not args.ignore_eos, timeout=args.timeout
        )
        stats = model.statistics()
    seq = gen.sequences[0]
    tokens = [int(t) for t in seq.new_ids]
    run = gen.statistics()
    if args.json:
        doc = {"tokens": tokens, "finish_reason": reason_of(seq), "seed": params.seed}
        doc.update(run, prompt_tokens=len(ids), **_model_stats(args, stats))
        if tok is not None:
            doc["text"] = tok.decode(tokens)
        print(json.dumps(doc))
        return 0
    print(",".join(map(str, tokens)))
    if tok is not None:
        print(tok.decode(tokens))
    rate = run.get("new_tokens_per_s")
    print(
        f"prefill {len(ids)} tokens in {run.get('prefill_s', 0.0):.3f} s; {len(tokens)} new tokens"
        + (f" at {rate:.1f} tokens/s" if rate else "")
        + f"; seed {params.seed}; stopped: {reason_of(seq)}",
        file=sys.stderr,
    )
    return 0


def generate_file(args) -> int:
    """`--prompts`: every request checked before the model loads, then the batches, a result
    line per sequence as it finishes."""
    from .prompts import LineSink, Results, read_prompts

    if args.logits:
        raise UsageError("--logits takes one prompt (--prompt-ids or --prompt), not --prompts")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1 with --prompts, got {args.max_new_tokens}")
    if args.policy_profile is not None and args.batch != "auto":
        raise UsageError("--policy-profile takes --batch auto")
    capacity, budget = _capacity(args)
    if args.out is not None:
        check_writable(args.out, "--out")
    if args.stats is not None:
        if Path(args.stats).suffix != ".json":
            raise UsageError(f"--stats {args.stats}: the statistics are written as .json")
        check_writable(args.stats, "--stats")
    vocab = _vocab(args.model)
    params = sampling_of(args, vocab).with_seed()
    tokenizer: list = []  # loaded by the first line given as text

    def encode(text: str) -> list[int]:
        if not tokenizer:
            tokenizer.append(_tokenizer(args.model, flag='"text"'))
        return tokenizer[0].encode(text).ids

    requests = read_prompts(args.prompts, vocab=vocab, max_new_tokens=args.max_new_tokens, encode=encode)
    decode = tokenizer[0].decode if tokenizer else None
    auto = _Auto(args) if args.batch == "auto" else None
    batch = 1 if auto else args.batch or 1
    batches: list[dict] = []
    with (
        _open_model(args, capacity) as model,
        LineSink(args.out, sys.stdout) as sink,
        _Progress(args, requests) as bar,
    ):
        model.watch(budget)
        start = 0
        while start < len(requests):
            if auto is not None:  # the first batch, and the first after the capacity changed
                batch = auto.choose(model, requests[start:], start)
            part = requests[start : start + batch]
            # micro-batches: the plans' choice per step, chosen again when the capacity changes
            stats = _run_batch(model, args, part, params, Results(part, decode), sink, bar)
            batches.append({"first": start, **stats, **(auto.predicted() if auto else {})})
            start += len(part)
        sink.commit()
        doc = run_statistics(batches, bar.generated, bar.spent, len(requests), batch)
        if auto is not None:
            doc["policy"] = auto.chosen
        doc.update(seed=params.seed if params.do_sample else None, **_model_stats(args, model.statistics()))
    if args.stats is not None:
        from disco_ray.graph.formats import write_doc

        write_doc(doc, args.stats)
    elif args.json:
        print(json.dumps(doc), file=sys.stderr)
    return 0


class _Auto:
    """`--batch auto`: the policy search (`disco_ray.bench.policy.for_checkpoint`) at the model's
    capacity, run again when a `--budget-file` has changed it; what it chose and predicted."""

    def __init__(self, args):
        from disco_ray.bench import profiles

        name = args.policy_profile or ("cpu" if args.backend == "cpu" else "h100")
        self.cost = profiles.measure_cpu(streams=args.streams) if name == "cpu" else profiles.get(name)
        self.name = name
        self.resizes = -1  # len(model.resizes) when it last chose
        self.chosen: list[dict] = []  # one per choice

    def choose(self, model, requests, start: int) -> int:
        """The batch size (the micro-batches are the plans' choice per step, `micro="auto"`)."""
        from disco_ray.bench import policy

        if len(model.resizes) != self.resizes or not self.chosen:
            self.resizes = len(model.resizes)
            got = policy.for_checkpoint(
                model.ck,
                gpus=model.gpus,
                prompt=max(len(r.ids) for r in requests),
                new_tokens=max(r.max_new_tokens for r in requests),
                capacity=model.capacity,
                cost=self.cost,
                block=model.block,
                dtype=model.dtype,
                tile=model.tile,
                host_capacity=model.host_capacity,
                batches=[b for b in policy.BATCHES if b < 2 * len(requests)],  # none beyond the prompts
            )
            self.chosen.append(
                {
                    "first": start,
                    "capacity": model.capacity,
                    "profile": self.name,
                    "batch": got.batch,
                    "micro": got.micro,  # the micro-batches the policy predicted with
                    "predicted_step_ms": round(1e3 * got.step_s, 3),
                    "predicted_tokens_per_s": round(got.tokens_per_s, 3),
                    "candidates": len(got.candidates),
                    "excluded": sum(not c.fits for c in got.candidates),
                }
            )
        return self.chosen[-1]["batch"]

    def predicted(self) -> dict:
        """The prediction of the choice the batch ran with, beside its measured figures."""
        last = self.chosen[-1]
        return {k: last[k] for k in ("predicted_step_ms", "predicted_tokens_per_s")}


def _run_batch(model, args, part, params, results, sink, bar) -> dict:
    """One batch, its result lines written as its sequences finish; returns its statistics. A
    failure names the `.partial` file that keeps the sequences finished so far."""
    from disco_ray.graph.errors import DiscoError

    def emit(doc: dict | None) -> None:
        if doc is not None:
            sink.write(doc)
            bar.finished()

    lengths = [r.max_new_tokens for r in part]
    t = time.perf_counter()
    try:
        gen = model.run_generate_batch(
            [list(r.ids) for r in part],
            lengths if len(set(lengths)) > 1 else lengths[0],
            sampling=params,
            stop_ids=[list(r.stop_ids) for r in part],  # each line's own, beside --stop-ids
            indices=[r.index for r in part],  # a line samples by its index in the file, whatever --batch
            stop_at_eos=not args.ignore_eos,
            on_finish=lambda seq: emit(results.finish(seq.index, seq.new_ids, reason_of(seq))),
            on_token=lambda _pos, _token: bar.token(),
            timeout=args.timeout,
        )
    except DiscoError as e:
        if sink.lines and sink.partial is not None:
            raise type(e)(f"{e} ({sink.lines} finished sequences are in {sink.partial})") from None
        raise
    bar.spent += time.perf_counter() - t
    bar.generated += sum(len(seq.new_ids) for seq in gen.sequences)
    for seq in gen.sequences:  # any the callback did not report
        emit(results.finish(seq.index, seq.new_ids, reason_of(seq)))
    return gen.statistics()


class _Progress:
    """The progress bar on stderr (sequences done, new tokens/s) and the run's token count."""

    def __init__(self, args, requests):
        from tqdm import tqdm

        shown = sys.stderr.isatty() or args.progress
        self.bar = tqdm(total=len(requests), unit="seq", desc="generate", file=sys.stderr, disable=not shown)
        self.tokens = 0  # new tokens reported so far, for the rate
        self.generated = 0  # new tokens of the batches done
        self.spent = 0.0  # seconds in the batches' runs
        self.t0 = time.perf_counter()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def token(self) -> None:
        self.tokens += 1
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{rate:.1f} new tokens/s", refresh=False)

    def finished(self) -> None:
        self.bar.update(1)


def reason_of(seq) -> str:
    """A `SequenceOutput`'s finish reason as the results write it: "stop" or "length"."""
    from disco_ray.models.sampling import FinishReason

    r = seq.finish_reason
    return r.value if isinstance(r, FinishReason) else str(r)


def _median(xs: list) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def run_statistics(batches: list[dict], new_tokens: int, spent: float, sequences: int, batch: int) -> dict:
    """The run's statistics from its batches' (`BatchGeneration.statistics()`, each with "first",
    its first prompt's number): totals and medians over every decode step of the run, and the
    batches themselves."""
    steps = [ms for b in batches for ms in (b.get("step_ms") or {}).get("list", [])]
    loaded = [n for b in batches for n in b.get("bytes_loaded_per_step", [])]
    return {
        "sequences": sequences,
        "new_tokens": new_tokens,
        "batch": batch,
        # the distinct micro-batch counts the steps ran with (prefills and decode steps)
        "micro": sorted({m for b in batches for m in [b.get("micro"), *b.get("micro_per_step", [])] if m}),
        "prefill_s": round(sum(b.get("prefill_s", 0.0) for b in batches), 6),
        "generate_s": round(spent, 6),  # in the batches' runs, prefill and planning included
        "new_tokens_per_s": round(new_tokens / spent, 3) if spent > 0 else None,
        "decode_steps": len(steps),
        "step_ms": _median(steps),  # the median decode step of the run
        "bytes_loaded_per_step": _median(loaded),  # the median decode step's input and reload bytes
        "batches": batches,
    }
