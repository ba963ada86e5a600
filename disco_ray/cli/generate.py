"""`disco-ray generate`: greedy generation with a Hugging Face LLaMA checkpoint.

    disco-ray generate MODEL_DIR --prompt-ids 1,2,3 --max-new-tokens 20 --gpus 2 --capacity 64MiB
        [--dtype float32|float16|bfloat16] [--engine ray|local] [--backend cpu|cuda] [--block 64]
        [--logits OUT.npz] [--json] [--prompt TEXT] [--ignore-eos] [--address auto] ...

Prints the new token ids, comma-separated, on one line (and, with --prompt, the decoded text on
the next). `--logits` writes the prompt's logits as the array `logits` [prompt length, vocab]
(float32); `--json` prints one JSON object instead: the tokens, prefill seconds, decode tokens/s,
planning seconds and bytes each plan offloads and reloads. `--max-new-tokens 0` only prefills.
`--prompt TEXT` needs the `tokenizers` package and the checkpoint's tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from disco_ray.graph.errors import UsageError

from .app import add_capacity_args, add_tier_args, capacity_of, command, seconds_arg
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


@command(
    "generate",
    help="greedy generation with a Hugging Face LLaMA checkpoint",
    description="Load MODEL_DIR onto GPUS workers with CAPACITY arena bytes each, prefill the "
    "prompt and decode greedily with a KV cache the workers keep. Prints the new token ids.",
)
def add_generate(p) -> None:
    p.add_argument("model", metavar="MODEL_DIR", help="config.json + model.safetensors (or shards)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt-ids", type=token_ids, metavar="IDS", help="prompt token ids, e.g. 1,2,3")
    what.add_argument("--prompt", metavar="TEXT", help="prompt text (needs tokenizers and tokenizer.json)")
    p.add_argument("--max-new-tokens", type=int, required=True, metavar="N", help="0: prefill only")
    p.add_argument(
        "--gpus", type=int, default=1, metavar="G", help="GPUs to split the model over (default 1)"
    )
    add_capacity_args(p)
    add_tier_args(p)  # --host-capacity, --disk
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: the checkpoint's")
    p.add_argument("--block", type=int, default=64, metavar="N", help="KV cache block, in tokens (64)")
    p.add_argument("--tile", type=int, metavar="N", help="prefill row tile, a multiple of --block (4 blocks)")
    p.add_argument("--logits", metavar="OUT.npz", help="write the prompt's logits as array 'logits'")
    p.add_argument("--json", action="store_true", help="print one JSON object with tokens and statistics")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--timeout", type=seconds_arg, metavar="S", help="give up a run after S seconds")
    p.add_argument(
        "--budget-file",
        metavar="FILE",
        help="a file holding the arena bytes per GPU (e.g. 4GiB), re-read between decode steps: "
        "the run frees or grows its arenas to follow it (elastic capacity)",
    )
    add_model_run_args(p)  # --weights, the engine's and the cluster's options


def _tokenizer(model: str):
    path = Path(model) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("--prompt needs the tokenizers package (pip install tokenizers)") from None
    if not path.exists():
        raise UsageError(f"--prompt needs {path}, which is missing (use --prompt-ids)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise UsageError(f"{path}: not a tokenizer file ({e})") from None


def cmd_generate(args) -> int:
    from disco_ray.models import LlamaModel

    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    capacity = capacity_of(args, args.gpus)
    budget = None
    if args.budget_file:
        from disco_ray.driver.elastic import BudgetFile

        budget = BudgetFile(args.budget_file)
        if capacity is None:
            capacity = budget.budget.capacity
    if capacity is None:
        raise UsageError("--capacity is required: the arena bytes of each GPU, e.g. 64MiB")
    if args.logits:
        out = Path(args.logits)
        if out.suffix != ".npz":
            raise UsageError(f"--logits {args.logits}: the logits are written as .npz")
        if not os.access(out.parent if str(out.parent) else ".", os.W_OK):
            raise UsageError(f"--logits {args.logits}: its directory is not writable")
    tok = _tokenizer(args.model) if args.prompt is not None else None
    ids = tok.encode(args.prompt).ids if tok is not None else args.prompt_ids
    kw = model_run_kwargs(args, args.gpus)
    with LlamaModel(
        args.model,
        gpus=args.gpus,
        capacity=capacity,
        dtype=args.dtype,
        block=args.block,
        tile=args.tile,
        **kw,
    ) as model:
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
            "plans": stats["plans"],
            "weight_bytes": stats["weight_bytes"],
            "gpus": args.gpus,
            "engine": args.engine,
            "backend": args.backend,
            "dtype": stats["dtype"],
            "resizes": stats["resizes"],
            "clamped_plans": stats["clamped_plans"],
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
