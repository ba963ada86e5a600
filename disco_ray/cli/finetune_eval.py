"""`disco-ray finetune`'s data, evaluation and progress options (the command is `finetune.py`).

    --data FILE          .npy int ids [rows, seq], or JSONL of {"text": ...} / {"ids": [...]}
    --eval-data FILE     the same formats; evaluated at the end, and every --eval-every N steps
    --seq-len N          tokens per row of a JSONL file (documents packed, EOS between them)
    --eval-batch B       rows per evaluation run (default: --batch, else all)
    --steps 0            evaluates the adapter (--init-adapter, else a new one: the base model)
                         on --eval-data alone: no --data, --lr or --out then

Each step prints one line on stderr as it ends (`progress.StepRecord.line`), each evaluation
one more; `--json` adds them all to the final object ("steps", "eval").
"""

from __future__ import annotations

import sys
from typing import IO

from disco_ray.graph.errors import UsageError

from .app import positive_int


def add_data_args(p) -> None:
    """--seq-len, --eval-data, --eval-every, --eval-batch."""
    p.add_argument(
        "--seq-len", type=positive_int, metavar="N", help="tokens per row of a JSONL file (packed)"
    )
    p.add_argument("--eval-data", metavar="FILE", help="held-out rows: .npy or JSONL, as --data")
    p.add_argument(
        "--eval-every", type=positive_int, metavar="N", help="evaluate every N steps (and at the end)"
    )
    p.add_argument("--eval-batch", type=positive_int, metavar="B", help="rows per evaluation run")


def check_modes(args) -> None:
    """Training (--steps >= 1) needs --data, --lr and --out; --steps 0 evaluates alone."""
    if args.steps < 0:
        raise UsageError(f"--steps must be >= 0, got {args.steps}")
    if args.eval_every is not None and args.eval_data is None:
        raise UsageError("--eval-every needs --eval-data")
    if args.steps == 0:
        if args.eval_data is None:
            raise UsageError("--steps 0 evaluates an adapter alone: give --eval-data")
        if args.out is not None:
            raise UsageError("--out with --steps 0: nothing is trained, so there is no adapter to write")
        return
    for flag, value in (("--data", args.data), ("--lr", args.lr), ("--out", args.out)):
        if value is None:
            raise UsageError(f"{flag} is needed to train (--steps {args.steps})")


def read_data(args):
    """(training rows or None, evaluation rows or None), every file checked before a model loads."""
    from disco_ray.models.textdata import load_tokens

    data = None if args.steps == 0 else load_tokens(args.data, args.model, args.seq_len, "--data")
    held = (
        None
        if args.eval_data is None
        else load_tokens(args.eval_data, args.model, args.seq_len, "--eval-data")
    )
    return data, held


class Progress:
    """The `on_step` of `LoraTrainer.train`: a line per step on `err`, and the evaluations."""

    def __init__(self, args, held, err: IO[str] | None = None):
        self.steps, self.every, self.held = args.steps, args.eval_every, held
        self.batch = args.eval_batch or args.batch
        self.timeout = args.timeout
        self.err = err or sys.stderr
        self.trainer = None  # set once the trainer exists
        self.records: list[dict] = []
        self.evals: list[dict] = []

    def step(self, rec) -> None:
        self.records.append(rec.as_dict())
        print(rec.line(self.steps), file=self.err, flush=True)
        if self.every is not None and rec.step % self.every == 0:
            self.evaluate(rec.step)

    def evaluate(self, step: int) -> None:
        assert self.trainer is not None and self.held is not None
        r = self.trainer.evaluate(self.held, self.batch, self.timeout)
        self.evals.append({"step": step, **r.as_dict()})
        print(f"step {step}: {r.line()}", file=self.err, flush=True)

    def finish(self) -> None:
        """The evaluation at the end, unless the last step's was one."""
        if self.held is not None and (not self.evals or self.evals[-1]["step"] != self.steps):
            self.evaluate(self.steps)

    def json(self) -> dict:
        return {"steps": self.records, "eval": self.evals}

    def lines(self) -> list[str]:
        """The evaluations as the plain output's last lines."""
        return [
            f"eval at step {e['step']}: loss {e['loss']:.6f} perplexity {e['perplexity']:.4f}"
            for e in self.evals
        ]
