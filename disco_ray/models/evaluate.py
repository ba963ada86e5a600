"""`LoraTrainer.evaluate`: the mean loss and perplexity of the adapter on the workers, forward only.

The rows are run `batch` at a time through the evaluation graph (`workloads.llm.eval_graph`:
the training step's forward and loss, no backward, no optimizer, no state saved), planned once
per shape (a last, shorter batch is one more shape). Each run returns the sum of its labelled
rows' cross-entropies; the mean is over every labelled token of every row, which is what
transformers' `model(input_ids=rows, labels=rows).loss` gives for all the rows at once.
"""

from __future__ import annotations

import time

import torch

from disco_ray.graph.errors import UsageError

from .progress import EvalResult


def evaluate(trainer, tokens: torch.Tensor, batch: int | None, timeout: float | None) -> EvalResult:
    """The loss of `trainer`'s adapter on `tokens` [rows, seq] (`batch` rows a run, default all)."""
    n, seq = tokens.shape
    batch = n if batch is None else batch
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise UsageError(f"the evaluation batch must be an integer >= 1, got {batch!r}")
    total, seconds = 0.0, 0.0
    for lo in range(0, n, batch):
        rows = tokens[lo : lo + batch]
        graph, prog = trainer._program(rows.shape[0], seq, evaluate=True)
        feed = graph.feed(trainer.config, rows, trainer.steps_done + 1)
        t = time.perf_counter()
        outs = prog.run(feed, timeout=timeout, **trainer.run_kw)
        seconds += time.perf_counter() - t
        total += float(outs[graph.loss].double().reshape(-1)[0])
    labelled = n * (seq - 1)
    return EvalResult(total / labelled, labelled, n, seconds)
