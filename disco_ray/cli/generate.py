"""`disco-ray generate`: generation with a Hugging Face LLaMA checkpoint, one prompt or a JSONL file.

    disco-ray generate MODEL_DIR --prompt-ids 1,2,3 --max-new-tokens 20 --gpus 2 --capacity 64MiB
        [--dtype float32|float16|bfloat16] [--engine ray|local] [--backend cpu|cuda] [--block 64]
        [--logits OUT.npz] [--json] [--prompt TEXT] [--ignore-eos] [--address auto] ...
    disco-ray generate MODEL_DIR --prompts IN.jsonl --batch 16 --max-new-tokens 32 --capacity 1GiB
        [--out OUT.jsonl] [--json] [--stats STATS.json] [--progress]
        [--temperature T] [--top-k K] [--top-p P] [--seed S] [--do-sample | --greedy] [--stop-ids 2,13]

One prompt: prints the new token ids, comma-separated, on one line as they are made (and, with
--prompt, the decoded text on the next); a run that fails late keeps them (--json: an object
with "finish_reason": "error"). `--logits` writes the prompt's logits as the array `logits` [prompt
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
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from disco_ray.graph.errors import DiscoError, UsageError

from .app import (
    add_capacity_args,
    add_tier_args,
    command,
    positive_int,
    seconds_arg,
    seed_arg,
    writable_file,
)
from .batches import add_file_args, generate_file, steps_per_call
from .llm import (
    capacity_and_budget,
    check_positions,
    model_stats,
    open_model,
    reason_of,
    sampling_of,
    tokenizer_of,
    vocab_of,
)
from .run import add_model_run_args


def token_ids(text: str) -> list[int]:
    """argparse type for `--prompt-ids 1,2,3`."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad token ids {text!r} (want integers: 1,2,3)") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


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
    _add_prompt_args(p)
    add_file_args(p)  # --batch, --policy-profile, --out, --stats, --progress
    _add_sampling_args(p)
    _add_run_args(p)


def _add_prompt_args(p) -> None:
    """What to generate from (one prompt, or a file of them) and how many new tokens."""
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


def _add_sampling_args(p) -> None:
    """The sampling options, one argument group."""
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


def _add_run_args(p) -> None:
    """Where and how the model runs: GPUs, capacity, tiers, dtype, KV block, outputs, the engine.
    `--capacity` or `--budget-file` is needed: a required group, so the usage line says so."""
    p.add_argument(
        "--gpus", type=int, default=1, metavar="G", help="GPUs to split the model over (default 1)"
    )
    sized = p.add_mutually_exclusive_group(required=True)  # its options adjacent: argparse shows it
    sized.add_argument(
        "--budget-file",
        metavar="FILE",
        help="a file holding the arena bytes per GPU (e.g. 4GiB), re-read between decode steps: "
        "the run frees or grows its arenas to follow it (elastic capacity)",
    )
    add_capacity_args(p, group=sized)
    add_tier_args(p)  # --host-capacity, --disk
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: the checkpoint's")
    p.add_argument("--block", type=int, default=64, metavar="N", help="KV cache block, in tokens (64)")
    p.add_argument(
        "--kv-cache",
        choices=["float", "int8"],
        default="float",
        help="how the KV cache is stored: in the compute dtype (float), or int8, group-wise per head "
        "(a scale and zero point per --kv-group elements): about 4x fewer bytes than float32 held, "
        "offloaded and reloaded (docs/QUANTIZATION.md#kv-cache-in-8-bits)",
    )
    p.add_argument(
        "--kv-group",
        type=positive_int,
        metavar="N",
        help="--kv-cache int8: elements per scale and zero point, a divisor of the head dimension "
        "(default: the head dimension)",
    )
    p.add_argument("--tile", type=int, metavar="N", help="prefill row tile, a multiple of --block (4 blocks)")
    p.add_argument(
        "--logits",
        type=writable_file("--logits"),
        metavar="OUT.npz",
        help="write the prompt's logits as array 'logits'",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one prompt: print one JSON object with the tokens and statistics; --prompts: the run's "
        "statistics as one JSON object on stderr (stdout carries the results unless --out)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--timeout", type=seconds_arg, metavar="S", help="give up a run after S seconds")
    p.add_argument(
        "--steps-per-call",
        type=positive_int,
        metavar="K",
        help="sampled or --prompts decoding: up to K decode steps per call to the workers, the tokens "
        "chosen on the device, each step's streamed back as it ends (default: the library's, 32; 1: a call per step)",
    )
    add_model_run_args(p)  # --weights, the engine's and the cluster's options
    p.set_defaults(streams=None)  # the model's own default (`default_streams`)
    for action in p._actions:
        if "--streams" in action.option_strings:
            action.help = "compute streams per GPU (default: 1 on the cpu backend, 5 on cuda)"


def _prompt_ids(args, vocab: int) -> tuple[list[int], Any]:
    """The one prompt's ids (and the tokenizer of --prompt, else None), checked against the vocabulary."""
    tok = tokenizer_of(args.model) if args.prompt is not None else None
    ids = tok.encode(args.prompt).ids if tok is not None else args.prompt_ids
    flag = "--prompt" if tok is not None else "--prompt-ids"
    if not ids:
        raise UsageError(f"{flag}: empty prompt (the text tokenizes to no ids)")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"{flag}: token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    return ids, tok


def cmd_generate(args) -> int:
    from disco_ray.models.train_defaults import default_streams

    if args.streams is None:
        args.streams = default_streams(args.backend)
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
        sampling_of(args, vocab_of(args.model))  # checked even when --max-new-tokens 0 samples nothing
        if args.max_new_tokens:
            return generate_sampled(args)
    return generate_one(args)


class _Stream:
    """The one prompt's new tokens on stdout as they are made, so a run that fails late keeps
    them: plain, the comma-separated line grows a token at a time (ended when the run ends);
    `--json`, one object at the end, or, when the run fails after a token, one with the tokens
    made, "finish_reason": "error" and the error."""

    def __init__(self, args, prompt_tokens: int, tok):
        self.json, self.prompt_tokens, self.tok = args.json, prompt_tokens, tok
        self.tokens: list[int] = []

    def token(self, t: int) -> None:
        self.tokens.append(int(t))
        if not self.json:
            sys.stdout.write(("," if len(self.tokens) > 1 else "") + str(int(t)))
            sys.stdout.flush()

    def end(self, doc: dict | None = None) -> None:
        """The run is done: the line ends (and the text follows), or `doc` is printed (--json)."""
        if self.json:
            if self.tok is not None:
                doc = {**(doc or {}), "text": self.tok.decode(self.tokens)}
            print(json.dumps(doc))
            return
        print()
        if self.tok is not None:
            print(self.tok.decode(self.tokens))

    @contextlib.contextmanager
    def keeping(self):
        """Around the run: a failure after the first token writes what was made, then goes on,
        its message saying where the tokens are."""
        try:
            yield self
        except BaseException as e:
            if not self.tokens:
                raise
            with contextlib.suppress(OSError, ValueError):  # stdout gone: nothing more to keep
                self.end(
                    {
                        "tokens": self.tokens,
                        "finish_reason": "error",
                        "error": str(e) or type(e).__name__,  # Ctrl-C says nothing of itself
                        "prompt_tokens": self.prompt_tokens,
                    }
                )
            if isinstance(e, DiscoError):
                raise type(e)(
                    f"{e} (the {len(self.tokens)} new tokens made before it are on stdout)"
                ) from None
            raise


def generate_one(args) -> int:
    """One prompt, greedy: `LlamaModel.run_generate`, its tokens streamed."""
    capacity, budget = capacity_and_budget(args)
    if args.logits:
        out = Path(args.logits)
        if out.suffix != ".npz":
            raise UsageError(f"--logits {args.logits}: the logits are written as .npz")
    ids, tok = _prompt_ids(args, vocab_of(args.model))
    check_positions(args.model, [(f"--max-new-tokens {args.max_new_tokens}", len(ids), args.max_new_tokens)])
    stream = _Stream(args, len(ids), tok)
    with stream.keeping(), open_model(args, capacity) as model:
        model.watch(budget)
        gen = model.run_generate(
            ids,
            args.max_new_tokens,
            stop_at_eos=not args.ignore_eos,
            prefill_logits=bool(args.logits),
            timeout=args.timeout,
            on_token=stream.token,
        )
        stats = model.statistics()
    if args.logits:
        from .npz import save_npz

        assert gen.prefill_logits is not None  # asked for
        save_npz(args.logits, {"logits": gen.prefill_logits.float()})
    s = gen.statistics()
    stream.end({**s, "prompt_tokens": len(ids), **model_stats(args, stats)})
    if not args.json:
        rate = s["decode_tokens_per_s"]
        print(
            f"prefill {len(ids)} tokens in {s['prompt_prefill_s']:.3f} s; "
            f"{s['decode_steps']} decode steps"
            + (f" at {rate:.1f} tokens/s" if rate else "")
            + f"; planning {s['planning_s']:.3f} s; stopped: {s['stopped']}",
            file=sys.stderr,
        )
    return 0


def generate_sampled(args) -> int:
    """One prompt with sampling or --stop-ids: a batch of one (`LlamaModel.run_generate_batch`),
    streamed and printed as `generate_one` prints."""
    if args.logits:
        raise UsageError(
            "--logits comes with greedy generation: leave out the sampling options and --stop-ids"
        )
    capacity, budget = capacity_and_budget(args)
    vocab = vocab_of(args.model)
    params = sampling_of(args, vocab).with_seed()
    ids, tok = _prompt_ids(args, vocab)
    check_positions(args.model, [(f"--max-new-tokens {args.max_new_tokens}", len(ids), args.max_new_tokens)])
    stream = _Stream(args, len(ids), tok)
    with stream.keeping(), open_model(args, capacity) as model:
        model.watch(budget)
        gen = model.run_generate_batch(
            [ids],
            args.max_new_tokens,
            sampling=params,
            stop_at_eos=not args.ignore_eos,
            timeout=args.timeout,
            on_token=lambda _seq, t: stream.token(t),
            **steps_per_call(args),
        )
        stats = model.statistics()
    seq = gen.sequences[0]
    run = gen.statistics()
    doc = {"tokens": [int(t) for t in seq.new_ids], "finish_reason": reason_of(seq), "seed": params.seed}
    doc.update(run, prompt_tokens=len(ids), **model_stats(args, stats))
    stream.end(doc)
    if not args.json:
        rate = run.get("new_tokens_per_s")
        print(
            f"prefill {len(ids)} tokens in {run.get('prefill_s', 0.0):.3f} s; {len(stream.tokens)} new tokens"
            + (f" at {rate:.1f} tokens/s" if rate else "")
            + f"; seed {params.seed}; stopped: {reason_of(seq)}",
            file=sys.stderr,
        )
    return 0
