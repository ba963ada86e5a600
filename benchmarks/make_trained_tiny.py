"""A small LLaMA trained here, in a few minutes on one CPU thread, for the quantization accuracy table.

    .venv/bin/python benchmarks/make_trained_tiny.py [--out /tmp/trained_tiny] [--steps 300]
        [--threads 1] [--seed 0]

The corpus is the text of Python's own documentation topics, `pydoc_data.topics.topics` (the
standard library ships it on every CPython install: what `help("if")` prints; about 465k
characters on CPython 3.11), its topics joined in key order. The first 90% of its characters
train, the last 10% are held out (`corpus()`: bench_quant_accuracy.py evaluates on them).

A byte-level BPE tokenizer of 2048 tokens (`tokenizers`, trained on the training text), then a
`transformers.LlamaForCausalLM` (hidden 256, MLP 688, 4 layers, 4 heads with 2 key/value heads,
untied LM head, float32) trained with AdamW on random 128-token windows of the training text,
16 a step; model, config and tokenizer saved with `save_pretrained`. Seeded, one thread and
torch's deterministic algorithms: the same steps give the same weights on the same machine and
torch version. Prints the held-out loss before and after (nats per token) and that of a unigram
model of the training tokens. 300 steps: about 4 minutes on an idle 2-core box (0.8 s a step).
A benchmark helper: nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: unk, bos, eos
SEQ = 128  # training and evaluation window, tokens
SHAPE = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    unk_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def corpus() -> tuple[str, str]:
    """(training text, held-out text): pydoc_data's topics in key order, split at 90% of the characters."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


def train_tokenizer(text: str):
    """A byte-level BPE (every byte has a token, so any text encodes) of SHAPE's vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPE["vocab_size"],
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    return tok


def windows(ids: torch.Tensor, seq: int) -> torch.Tensor:
    """The non-overlapping windows of `seq` tokens of `ids` [n] (a shorter tail dropped): [rows, seq]."""
    rows = len(ids) // seq
    return ids[: rows * seq].view(rows, seq)


def held_out_loss(model, rows: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) over every position of `rows` [n, seq] but the last."""
    with torch.no_grad():
        total = sum(float(model(input_ids=r[None], labels=r[None]).loss) for r in rows)
    return total / len(rows)


def unigram_loss(train_ids: torch.Tensor, held: torch.Tensor, vocab: int) -> float:
    """Held-out loss (nats/token) of the training tokens' add-one smoothed frequencies: a baseline
    that knows no context, to compare the model's with."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1
    return float(-(counts / counts.sum()).log()[held].mean())


def train(model, ids: torch.Tensor, steps: int, batch: int, seed: int, lr: float) -> list[float]:
    """AdamW on `batch` random windows of `ids` a step, warm-up then cosine decay; the losses."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (s + 1) / warm if s < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / steps)),
    )
    losses = []
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - SEQ, (batch,), generator=gen)
        x = torch.stack([ids[s : s + SEQ] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 20 == 0 or step == steps - 1:
            print(f"step {step}: loss {losses[-1]:.3f}", flush=True)
    model.eval()
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/trained_tiny", help="the checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=300, help="AdamW steps")
    ap.add_argument("--batch", type=int, default=16, help="windows of 128 tokens per step")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import transformers

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    text, held = corpus()
    tok = train_tokenizer(text)
    ids = torch.tensor(tok.encode(text).ids)
    val = windows(torch.tensor(tok.encode(held).ids), SEQ)
    print(
        f"pydoc_data.topics (Python {sys.version.split()[0]}): {len(text)} + {len(held)} characters, "
        f"{len(ids)} training tokens, {val.numel()} held-out tokens"
    )
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    before = held_out_loss(model.eval(), val)
    t = time.perf_counter()
    losses = train(model, ids, args.steps, args.batch, args.seed, args.lr)
    seconds = time.perf_counter() - t
    after = held_out_loss(model, val)
    unigram = unigram_loss(ids, torch.tensor(tok.encode(held).ids), SHAPE["vocab_size"])
    out = Path(args.out)
    model.save_pretrained(out)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    fast.save_pretrained(out)
    info = {
        "corpus": f"pydoc_data.topics, Python {sys.version.split()[0]}",
        "steps": args.steps,
        "batch": args.batch,
        "seq": SEQ,
        "seed": args.seed,
        "threads": args.threads,
        "train_s": round(seconds, 1),
        "train_loss_last": round(losses[-1], 4),
        "held_out_loss_before": round(before, 4),
        "held_out_loss": round(after, 4),
        "held_out_loss_unigram": round(unigram, 4),
        "ln_vocab": round(math.log(SHAPE["vocab_size"]), 4),
    }
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    print(
        f"trained {args.steps} steps in {seconds:.0f} s; held-out loss {before:.3f} -> {after:.3f} "
        f"nats/token (unigram {unigram:.3f}, ln vocab {info['ln_vocab']}); saved {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
