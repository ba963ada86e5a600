"""What a fine-tuning run reports as it goes: one record per optimizer step, one per evaluation.

`LoraTrainer` keeps a `StepRecord` per step (`records`) and hands each to the caller's `on_step`
as soon as the step ends; `LoraTrainer.evaluate` returns an `EvalResult`. `line()` is the
one-line text `disco-ray finetune` prints on stderr, `as_dict()` what `--json` prints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One optimizer step's figures."""

    step: int  # 1, 2, ... counted from the trainer's start
    loss: float  # the step's mean next-token cross-entropy
    lr: float  # the learning rate the step's update used
    tokens: int  # tokens the step read (batch x seq)
    seconds: float  # the step's run, wall clock

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.inf

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "seconds": round(self.seconds, 6),
        }

    def line(self, steps: int | None = None) -> str:
        of = f"/{steps}" if steps is not None else ""
        return (
            f"step {self.step}{of}: loss {self.loss:.6f} lr {self.lr:.3g} "
            f"{self.tokens_per_s:.1f} tokens/s {self.seconds:.3f} s"
        )


@dataclass(frozen=True, slots=True)
class EvalResult:
    """The loss of an adapter on a set of rows, forward only."""

    loss: float  # mean next-token cross-entropy over every labelled token of every row
    tokens: int  # labelled tokens: rows x (seq - 1)
    rows: int
    seconds: float  # the evaluation's runs, wall clock

    @property
    def perplexity(self) -> float:
        return math.inf if self.loss > 709.0 else math.exp(self.loss)  # exp overflows a float beyond

    def as_dict(self) -> dict:
        return {**asdict(self), "perplexity": self.perplexity, "seconds": round(self.seconds, 6)}

    def line(self) -> str:
        return (
            f"eval loss {self.loss:.6f} perplexity {self.perplexity:.4f} "
            f"({self.rows} rows, {self.tokens} tokens, {self.seconds:.3f} s)"
        )
