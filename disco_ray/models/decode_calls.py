"""A batch's decode steps, several per call (`steps_per_call`): the tokens are chosen on the device
(`workloads.llm.decode_sample`) and each step's tokens are carried into the next step's token
inputs inside the call (`Program.run_steps`), which ends after the step where a live sequence
finishes (a stop id or its last new token: the `finished_rows` flags) so that the driver finishes
and compacts rows between calls as between steps.

What a call of K steps needs is known before it starts: the rotary rows, spans and cache
index of steps p..p+K-1 (`feed_decode` per step), each live row's draws (its sampler's next K
numbers, `SequenceSampler.peek`: only those of the tokens made are used), its stop ids and how
many new tokens it may still make. K is capped so that every step stays in the cache block of
the first (the same plan key) and makes no more tokens than the live sequence closest to its
maximum may.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from disco_ray.graph.errors import NonFiniteError, RunError, UsageError
from disco_ray.graph.kernels_sample import PADDING
from disco_ray.graph.memgraph import MKind
from workloads.llm.batch import BatchLayout
from workloads.llm.decode_sample import feed_decode_steps, feed_sampling, token_carry

from .sampling import SamplingParams, SequenceSampler

STEPS_PER_CALL = 32  # decode steps per call by default: a call's own cost is paid once (tokens still stream)
MIN_STOPS = 4  # stop ids per row of a decode graph: a request's rounded up to a power of two >= this


def stop_width(ends: list[SamplingParams]) -> int:
    """The stop-id columns of the decode graph for sequences of these stop ids."""
    n = max((len(set(e.stop_ids)) for e in ends), default=0)
    return max(MIN_STOPS, 1 << max(0, n - 1).bit_length())


def steps_in_call(steps_per_call: int, p: int, block: int, left: list[int]) -> int:
    """The steps of the call from cache index p: at most `steps_per_call`, within p's cache block,
    and no more than the live row with the fewest new tokens `left` may make."""
    return max(1, min(steps_per_call, block - p % block, min(left)))


def decode_call(
    model: Any,
    book: Any,
    layout: BatchLayout,
    p: int,
    key: tuple[int, int, int, int],
    k: int,
    params: SamplingParams,
    own: list[SequenceSampler],
    timeout: float | None,
    done: int = 0,
    names: Sequence[int] | None = None,
    on_step: Callable[[torch.Tensor], None] | None = None,
) -> tuple[list[torch.Tensor], float, list[int]]:
    """Up to `k` decode steps of every row of `book` (a `batch.BatchRows`) from cache index p in
    one `run_steps` call of the plan of `key` (rows, cache blocks, micro-batches, stop ids per
    row): (each step's tokens [rows], the call's seconds, each step's bytes loaded). `on_step`
    gets each step's tokens as soon as that step ends, while the call goes on. Non-finite
    logits end it with a NonFiniteError naming the decode step (`done` before this call) and the
    sequence (`names[s]`: its `indices` entry)."""
    rows, blocks, m, width = key
    mgraph, prog = model._program(("batch_decode", rows, blocks, m, width))
    live = book.live()
    seqs = [book.rows[r] for r in live]
    stops = torch.full((rows, width), -1, dtype=torch.int64)
    for r, s in zip(live, seqs, strict=True):
        ids = sorted(set(book.ends[s].stop_ids))
        stops[r, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    sampled = params.do_sample
    draws = [own[s].peek(k) for s in seqs] if sampled else []
    temp = float(params.temperature) if sampled else 0.0  # 0: greedy
    knobs = torch.tensor([temp, params.top_k, params.top_p], dtype=torch.float64)
    feeds = feed_decode_steps(mgraph, model.config, layout.offsets, book.tokens(), p, k)
    for j, feed in enumerate(feeds):
        u = torch.full((rows,), PADDING, dtype=torch.float64)
        left = torch.zeros(rows, dtype=torch.int64)
        for i, (r, s) in enumerate(zip(live, seqs, strict=True)):
            u[r] = draws[i][j] if sampled else 0.0
            left[r] = book.maxes[s] - len(book.new[s]) - j
        feed |= feed_sampling(mgraph, u, left, knobs if j == 0 else None, stops if j == 0 else None)

    def picked(outs: dict[str, torch.Tensor]) -> torch.Tensor:  # a step's tokens [rows]
        return torch.cat([outs[x] for _, x in mgraph.tokens])

    streamed = None if on_step is None else lambda _k, o: on_step(picked(o))
    t = time.perf_counter()
    try:
        outs = prog.run_steps(
            feeds,
            carry=token_carry(mgraph),
            halt=mgraph.finished,
            on_step=streamed,
            check=model.check,
            timeout=timeout,
        )
    except RunError as e:
        bad = re.search(r"non-finite logits in row (\d+): (.*?) \(", str(e))
        if bad is None:
            raise
        s = book.rows[int(bad.group(1))]
        raise NonFiniteError(
            f"decode step {done + (e.step or 0) + 1}: the logits of sequence "
            f"{names[s] if names is not None else s} hold {bad.group(2)}: no token is sampled from them"
        ) from None
    dt = time.perf_counter() - t
    return [picked(o) for o in outs], dt, [loaded(prog.mg, recs) for recs in prog.last_steps]


def advance(
    book: Any, steps: list[list[int]], on_token, finish, own: list[SequenceSampler] | None = None
) -> None:
    """Each step's tokens (one per row of `book`, a `batch.BatchRows`, in order) to the live rows'
    sequences, as they were made: streamed to `on_token`, a sequence that ends to `finish`; a
    padding row's token is dropped. `own`: the sequences' samplers, whose draws the device used
    (`peek`), each now used once per token made."""
    for toks in steps:
        live = book.live()
        if not live:
            return
        for s, t, why in book.advance([toks[r] for r in live]):
            if own:
                own[s].skip(1)
            if on_token is not None:
                on_token(s, t)
            if why is not None:
                finish(s)


def check_steps_per_call(n: object) -> int:
    """`steps_per_call=`: an integer >= 1, else UsageError."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"steps_per_call must be an integer >= 1, got {n!r}")
    return n


def loaded(mg, records: list) -> int:
    """Bytes a step loaded into the arenas: inputs (skipped loads, of no length, excluded) and
    reloads; `records` per GPU, tuples or `actors.steps.records_array`s."""
    total = 0
    for recs in records:
        for vid, _, a, b in recs.tolist() if isinstance(recs, np.ndarray) else recs:
            v = mg.vertex(vid)
            if (v.kind is MKind.INPUT and a != b) or v.kind is MKind.RELOAD:
                total += v.out.nbytes
    return total
