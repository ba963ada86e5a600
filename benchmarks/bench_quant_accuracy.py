"""Accuracy of quantized weights: next-token distributions of int8 and int4 against float32.

    .venv/bin/python benchmarks/bench_quant_accuracy.py [--dir /tmp/bench_llama] [--text FILE]
        [--tokenizer DIR] [--windows 16] [--length 128] [--bits 8,4] [--groups 32,64,128]
        [--capacity auto] [--block 64] [--engine local] [--json out.json]

For a checkpoint (default: the 0.49 GB random one of bench_llama_cpu.py, made once if missing),
disco-ray's prefill logits of --windows text windows of --length tokens each, float32 and then
per --bits and --groups (`LlamaModel(quantize=, quant_group=)`, docs/QUANTIZATION.md). Per
quantized setting, over every position of every window:

- mean KL(float32 || quantized) of the next-token distributions (nats): what the quantized model
  loses of the float one's predictions, weighted as the float model weights them;
- top-1 agreement: the share of positions whose argmax is the float model's;
- the largest absolute logit error;
- the mean next-token loss on the text (nats/token) and its change from float32.

The text: --text FILE, or by default the held-out 10% of make_trained_tiny.py's corpus (Python's
`pydoc_data.topics`). Tokens: the tokenizer.json of --tokenizer (default: the checkpoint's own),
or with none, the text's UTF-8 bytes as ids (a byte beyond the vocabulary is refused). The header
gives the float model's mean entropy against ln(vocabulary) and its median top-1 margin (logit
of the first minus the second): a nearly flat distribution (random weights) flips its argmax on
small errors, so there top-1 agreement says little and KL is the figure to read.
A benchmark: nothing here is a test (tests/test_quant_accuracy.py checks its functions).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def kl_divergence(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(got)) per row of logits [n, vocab], in float64 (nats): [n]."""
    p = torch.log_softmax(ref.double(), dim=-1)
    q = torch.log_softmax(got.double(), dim=-1)
    return (p.exp() * (p - q)).sum(-1)


def top1_agreement(ref: torch.Tensor, got: torch.Tensor) -> float:
    """The share of rows of logits [n, vocab] whose argmax is the same in `ref` and `got`."""
    return float((ref.argmax(-1) == got.argmax(-1)).double().mean())


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropies (nats) of each next token ids[1:] under logits[:-1] of one window: [len - 1]."""
    return torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="none")


def float_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [n, vocab]: the entropy (nats) and the top-1 margin (first minus second logit)."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    top = logits.double().topk(2, dim=-1).values
    return -(lp.exp() * lp).sum(-1), top[:, 0] - top[:, 1]


def summarize(refs: list[torch.Tensor], gots: list[torch.Tensor], windows: list[torch.Tensor]) -> dict:
    """One quantized setting's figures over every window's logits against the float ones'."""
    ref, got = torch.cat(refs), torch.cat(gots)
    loss = torch.cat([next_token_loss(g, ids) for g, ids in zip(gots, windows)])
    kl = kl_divergence(ref, got)
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1": top1_agreement(ref, got),
        "max_abs_err": float((ref - got).abs().max()),
        "loss": float(loss.mean()),
    }


def encode(text: str, tokenizer: Path | None, vocab: int) -> list[int]:
    """`text`'s ids: by `tokenizer`'s tokenizer.json, or its UTF-8 bytes (each below `vocab`)."""
    from disco_ray.graph.errors import UsageError

    if tokenizer is not None:
        from tokenizers import Tokenizer

        ids = (
            Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        )
    else:
        ids = list(text.encode("utf-8"))
    bad = next((i for i, t in enumerate(ids) if t >= vocab), None)
    if bad is not None:
        what = "token" if tokenizer is not None else "byte (no tokenizer.json: bytes are the ids)"
        raise UsageError(
            f"the text's {what} {ids[bad]} at token {bad} is outside the vocabulary 0..{vocab - 1}"
        )
    return ids


def text_windows(ids: list[int], n: int, length: int) -> list[torch.Tensor]:
    """The first `n` non-overlapping windows of `length` ids; too short a text is refused."""
    from disco_ray.graph.errors import UsageError

    if n < 1 or length < 2:
        raise UsageError(f"--windows must be >= 1 and --length >= 2, got {n} and {length}")
    if len(ids) < n * length:
        raise UsageError(f"the text has {len(ids)} tokens, fewer than {n} windows of {length}")
    return [torch.tensor(ids[k * length : (k + 1) * length]) for k in range(n)]


def prefill_all(
    path: str, windows: list[torch.Tensor], args, quantize: str | None, group: int
) -> list[torch.Tensor]:
    """disco-ray's prefill logits of each window, float32 compute, weights as `quantize` says."""
    from disco_ray.models import LlamaModel

    kw = dict(capacity=args.capacity, block=args.block, engine=args.engine, dtype="float32")
    with LlamaModel(path, quantize=quantize, quant_group=group, **kw) as m:  # type: ignore[arg-type]
        return [m.prefill(w.tolist()).float() for w in windows]


def header(path: str, ref: list[torch.Tensor], windows: list[torch.Tensor], args, source: str) -> dict:
    """What the float model does on the text: its loss, entropy against ln(vocab), top-1 margin."""
    logits = torch.cat(ref)
    entropy, margin = float_stats(logits)
    loss = torch.cat([next_token_loss(r, ids) for r, ids in zip(ref, windows)])
    return {
        "model": path,
        "text": source,
        "windows": len(windows),
        "length": args.length,
        "vocab": logits.shape[-1],
        "ln_vocab": math.log(logits.shape[-1]),
        "float32_loss": float(loss.mean()),
        "float32_entropy": float(entropy.mean()),
        "float32_top1_margin_median": float(margin.median()),
        "float32_logit_std": float(logits.std()),
    }


def table(head: dict, rows: list[dict]) -> str:
    """The markdown table of the rows, under a line about the float model."""
    out = [
        f"{head['model']}: {head['windows']} windows of {head['length']} tokens of {head['text']}; "
        f"float32 loss {head['float32_loss']:.3f} nats/token, entropy {head['float32_entropy']:.3f} "
        f"of ln(vocab) {head['ln_vocab']:.3f}, median top-1 margin {head['float32_top1_margin_median']:.4f}",
        "",
        "| weights | group | mean KL (nats) | max KL | top-1 agreement | max abs logit error | loss | loss - float32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['weights']} | {r['group']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {100 * r['top1']:.1f}% "
            f"| {r['max_abs_err']:.3g} | {r['loss']:.4f} | {r['loss'] - head['float32_loss']:+.4f} |"
        )
    return "\n".join(out)


def parse_ints(s: str, what: str) -> list[int]:
    from disco_ray.graph.errors import UsageError

    try:
        return [int(x) for x in s.split(",")]
    except ValueError:
        raise UsageError(f"{what} must be integers separated by commas, got {s!r}") from None


def read_text(path: str) -> str:
    """The UTF-8 text of `path`; a missing or unreadable file is a usage error naming it."""
    from disco_ray.graph.errors import UsageError

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--text {path}: {e}") from None


def run(args) -> dict:
    """Every setting's figures (the json); prints the table."""
    from workloads.llm.checkpoint import Checkpoint

    if args.dir is None:
        from bench_llama_cpu import checkpoint

        args.dir = str(checkpoint(Path("/tmp/bench_llama")))
    vocab = Checkpoint(args.dir).config.vocab
    if args.text:
        text, source = read_text(args.text), args.text
    else:
        from make_trained_tiny import corpus

        text, source = corpus()[1], f"pydoc_data.topics' held-out 10% (Python {sys.version.split()[0]})"
    tok = Path(args.tokenizer or args.dir)
    tok_dir = tok if (tok / "tokenizer.json").exists() else None
    if args.tokenizer and tok_dir is None:
        from disco_ray.graph.errors import UsageError

        raise UsageError(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    windows = text_windows(encode(text, tok_dir, vocab), args.windows, args.length)
    source += ", tokenized by " + (f"{tok_dir}/tokenizer.json" if tok_dir else "UTF-8 bytes")
    bits, groups = parse_ints(args.bits, "--bits"), parse_ints(args.groups, "--groups")
    ref = prefill_all(args.dir, windows, args, None, 64)
    head = header(args.dir, ref, windows, args, source)
    rows = []
    for b in bits:
        for g in groups:
            got = prefill_all(args.dir, windows, args, f"int{b}", g)
            rows.append({"weights": f"int{b}", "group": g, **summarize(ref, got, windows)})
            print(f"int{b} group {g}: done", file=sys.stderr, flush=True)
    print(table(head, rows))
    return {**head, "load": os.getloadavg(), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    from disco_ray.graph.errors import UsageError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="the checkpoint (default: bench_llama_cpu.py's, in /tmp/bench_llama)")
    ap.add_argument("--text", help="a UTF-8 text file (default: pydoc_data.topics' held-out part)")
    ap.add_argument("--tokenizer", help="a directory with the tokenizer.json to use (default: --dir's)")
    ap.add_argument("--windows", type=int, default=16, help="text windows")
    ap.add_argument("--length", type=int, default=128, help="tokens per window")
    ap.add_argument("--bits", default="8,4", help="quantized widths, e.g. 8,4")
    ap.add_argument("--groups", default="32,64,128", help="group sizes, e.g. 32,64,128")
    ap.add_argument("--capacity", default="auto", help="arena bytes per GPU (as LlamaModel's)")
    ap.add_argument("--block", type=int, default=64, help="KV cache block (tokens)")
    ap.add_argument("--engine", default="local", choices=["local", "ray"])
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    try:
        out = run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
