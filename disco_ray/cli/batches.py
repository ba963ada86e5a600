"""`disco-ray generate --prompts FILE.jsonl`: the prompts run in batches (`--batch N|auto`), a
result line per sequence as it finishes, the run's statistics (`disco_ray.cli.prompts` says the
formats)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from disco_ray.graph.errors import UsageError

from .app import positive_int, writable_file
from .llm import capacity_and_budget, model_stats, open_model, reason_of, sampling_of, tokenizer_of, vocab_of


def batch_arg(text: str) -> int | str:
    """argparse type for `--batch N|auto`: prompts per batch, >= 1, or "auto" (the policy search)."""
    return "auto" if text == "auto" else positive_int(text)


def add_file_args(p) -> None:
    """The options of `--prompts` (the batches, where the results and statistics go)."""
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
        type=writable_file("--out"),
        metavar="FILE.jsonl",
        help="--prompts: write the results here (via FILE.jsonl.partial, renamed when all are done)",
    )
    p.add_argument(
        "--stats",
        type=writable_file("--stats"),
        metavar="FILE.json",
        help="--prompts: write the run's statistics here (as --json does on stderr)",
    )
    p.add_argument(
        "--progress",
        action="store_true",
        help="--prompts: a progress bar on stderr (sequences done, new tokens/s) even when it is no terminal",
    )


def generate_file(args) -> int:
    """`--prompts`: every request checked before the model loads, then the batches, a result
    line per sequence as it finishes."""
    from .llm import check_positions
    from .prompts import LineSink, Results, read_prompts

    if args.logits:
        raise UsageError("--logits takes one prompt (--prompt-ids or --prompt), not --prompts")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1 with --prompts, got {args.max_new_tokens}")
    if args.policy_profile is not None and args.batch != "auto":
        raise UsageError("--policy-profile takes --batch auto")
    capacity, budget = capacity_and_budget(args)
    if args.stats is not None and Path(args.stats).suffix != ".json":
        raise UsageError(f"--stats {args.stats}: the statistics are written as .json")
    vocab = vocab_of(args.model)
    params = sampling_of(args, vocab).with_seed()
    tokenizer: list = []  # loaded by the first line given as text

    def encode(text: str) -> list[int]:
        if not tokenizer:
            tokenizer.append(tokenizer_of(args.model, flag='"text"'))
        return tokenizer[0].encode(text).ids

    requests = read_prompts(args.prompts, vocab=vocab, max_new_tokens=args.max_new_tokens, encode=encode)
    check_positions(
        args.model, [(f"{args.prompts}:{r.line}", len(r.ids), r.max_new_tokens) for r in requests]
    )
    decode = tokenizer[0].decode if tokenizer else None
    auto = _Auto(args) if args.batch == "auto" else None
    batch = 1 if auto else args.batch or 1
    batches: list[dict] = []
    with (
        open_model(args, capacity) as model,
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
        doc.update(seed=params.seed if params.do_sample else None, **model_stats(args, model.statistics()))
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
                capacity=model.capacity_limit(),  # under --capacity auto: the budget it grows to
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


def steps_per_call(args) -> dict:
    """`--steps-per-call` as `run_generate_batch`'s keyword (none: the library's default)."""
    return {} if args.steps_per_call is None else {"steps_per_call": args.steps_per_call}


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
            **steps_per_call(args),
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
