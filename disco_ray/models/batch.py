"""Batched generation: many prompts of different lengths, one run per step for the whole batch.

The graphs and the cache layout are `workloads.llm.batch`'s (left-aligned cache index, per-row
KV cache states, micro-batches). This module is the loop around them (`run_batch`, what
`LlamaModel.run_generate_batch` runs) and what it returns:

- the prompts are prefilled together, in one run; then each decode step advances every
  unfinished sequence in one run of one plan, so each weight block is loaded once per step;
- micro-batches (`micro="auto"`, the default) are the plans' choice, `LlamaModel.choose_micro`:
  per (step kind, rows, cache blocks) at the current capacity, the split whose plan moves the
  fewest bytes between host and device, made once per capacity (a resize between calls makes
  the next call choose again);
- plans are keyed by (rows, cache blocks, micro-batches), with rows the live sequences rounded up
  to a power of two: a finished sequence's row stays as padding (token 0, output ignored) until
  the live count falls to the next lower power of two, when the batch is compacted: the live
  rows' KV cache states are renamed to rows 0..B'-1 and the others dropped on the workers
  (`move_states`: no data copied, memory freed). So a batch of B makes at most log2(B) + 1 row
  counts, each planned once per cache block reached, and later calls reuse every plan;
- the next tokens are chosen on the device that holds the logits, in the decode graph
  (`disco_ray.models.sampling`'s math: greedy by default, or sampling with one generator per
  sequence by its index, its place in the call unless `indices=` names it otherwise, so a
  sequence's tokens do not depend on its batch, nor on how a caller splits its prompts into
  calls); the prefill's, on the driver. Each Ray call runs up to `steps_per_call` decode steps,
  the tokens carried from step to step on the workers, and ends after the step where a
  sequence finishes (`disco_ray.models.decode_calls`);
- a sequence ends at the request's stop ids, its own (`stop_ids=`, one list per prompt), the
  end-of-sequence ids or its own maximum, and its row is free from that step on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import Any

import torch

from disco_ray.graph.errors import UsageError
from workloads.llm.batch import BatchLayout, feed_prefill, state_ids

from .decode_calls import (
    STEPS_PER_CALL,
    advance,
    check_steps_per_call,
    decode_call,
    steps_in_call,
    stop_width,
)
from .sampling import FinishReason, SamplingParams, finish_reason, sample, samplers


@dataclass(frozen=True, slots=True)
class SequenceOutput:
    """One sequence of a batch, once it has finished."""

    index: int  # its place in the request's list of prompts
    prompt_ids: list[int]
    new_ids: list[int]
    finish_reason: str  # "stop" (a stop id or end-of-sequence, included) or "length"


@dataclass(slots=True)
class BatchGeneration:
    """What one `LlamaModel.run_generate_batch` did."""

    sequences: list[SequenceOutput]  # in request order
    batch: int  # rows of the first step (the live sequences rounded up to a power of two)
    micro: int  # micro-batches of the prefill (micro="auto": the plans' choice, see `micros`)
    prefill_s: float = 0.0  # the prefill run (planning excluded)
    decode_s: list[float] = field(default_factory=list)  # each decode step's run
    rows: list[int] = field(default_factory=list)  # each decode step's rows (compaction shrinks them)
    micros: list[int] = field(default_factory=list)  # each decode step's micro-batches
    planning_s: float = 0.0  # plans made during this call
    plans_made: int = 0
    bytes_loaded: list[int] = field(default_factory=list)  # per decode step: input and reload bytes
    prefill_bytes_loaded: int = 0
    prefill_logits: torch.Tensor | None = None  # [sequences, vocab]: each prompt's last token's, when asked

    def statistics(self) -> dict:
        """A JSON-able summary: new tokens/s counts every new token over prefill and decode time."""
        new = sum(len(s.new_ids) for s in self.sequences)
        steps = sorted(self.decode_s)
        total = self.prefill_s + sum(self.decode_s)
        return {
            "sequences": len(self.sequences),
            "new_tokens": new,
            "prefill_s": round(self.prefill_s, 6),
            "decode_steps": len(self.decode_s),
            "decode_s": round(sum(self.decode_s), 6),
            "new_tokens_per_s": round(new / total, 3) if total > 0 else None,
            "step_ms": {
                "median": round(1e3 * steps[len(steps) // 2], 3) if steps else None,
                "list": [round(1e3 * s, 3) for s in self.decode_s],
            },
            "bytes_loaded_per_step": list(self.bytes_loaded),
            "prefill_bytes_loaded": self.prefill_bytes_loaded,
            "batch": self.batch,
            "rows_per_step": list(self.rows),
            "micro": self.micro,
            "micro_per_step": list(self.micros),
            "planning_s": round(self.planning_s, 6),
            "plans_made": self.plans_made,
            "finish_reasons": {
                r: sum(s.finish_reason == r for s in self.sequences) for r in ("stop", "length")
            },
        }


def pow2(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def check_prompts(prompts: object, vocab: int) -> list[list[int]]:
    """The prompts as lists of ints; UsageError naming the sequence and the id otherwise."""
    if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)) or not prompts:
        raise UsageError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, Sequence) or isinstance(p, (str, bytes)):
            raise UsageError(f"sequence {i}: a prompt must be a list of token ids, got {type(p).__name__}")
        if not p:
            raise UsageError(f"sequence {i}: the prompt has no token ids")
        ids = []
        for x in p:
            if isinstance(x, bool) or not isinstance(x, Integral):
                raise UsageError(f"sequence {i}: token id {x!r} is not an integer")
            x = int(x)
            if not 0 <= x < vocab:
                raise UsageError(f"sequence {i}: token id {x} is outside the vocabulary 0..{vocab - 1}")
            ids.append(x)
        out.append(ids)
    return out


def check_max_new(max_new_tokens: object, n: int) -> list[int]:
    """max_new_tokens per sequence: one int for all or a list of n; UsageError otherwise."""
    each = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * n
    if len(each) != n:
        raise UsageError(f"max_new_tokens has {len(each)} entries for {n} prompts")
    for i, m in enumerate(each):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise UsageError(f"sequence {i}: max_new_tokens must be an integer >= 0, got {m!r}")
    return list(each)


def check_stop_ids(stop_ids: object, n: int, vocab: int) -> list[tuple[int, ...]]:
    """Each sequence's own stop ids (None: none), a list of token-id lists, one per prompt;
    UsageError naming the sequence and the id otherwise."""
    if stop_ids is None:
        return [()] * n
    if not isinstance(stop_ids, Sequence) or isinstance(stop_ids, (str, bytes)):
        raise UsageError(
            f"stop_ids must be a list of token-id lists, one per prompt, got {type(stop_ids).__name__}"
        )
    if len(stop_ids) != n:
        raise UsageError(f"stop_ids has {len(stop_ids)} entries for {n} prompts")
    out = []
    for i, own in enumerate(stop_ids):
        if not isinstance(own, Sequence) or isinstance(own, (str, bytes)):
            raise UsageError(f"sequence {i}: its stop ids must be a list of token ids, got {own!r}")
        ids = []
        for x in own:
            if isinstance(x, bool) or not isinstance(x, Integral):
                raise UsageError(f"sequence {i}: stop id {x!r} is not an integer")
            if not 0 <= int(x) < vocab:
                raise UsageError(f"sequence {i}: stop id {x} is outside the vocabulary 0..{vocab - 1}")
            ids.append(int(x))
        out.append(tuple(ids))
    return out


def check_indices(indices: object, n: int) -> list[int]:
    """Each sequence's index, which seeds its sampler (None: its place in the call, 0..n-1);
    distinct integers >= 0, else UsageError."""
    if indices is None:
        return list(range(n))
    if not isinstance(indices, Sequence) or isinstance(indices, (str, bytes)):
        raise UsageError(f"indices must be a list of integers, one per prompt, got {type(indices).__name__}")
    if len(indices) != n:
        raise UsageError(f"indices has {len(indices)} entries for {n} prompts")
    seen: dict[int, int] = {}
    for i, x in enumerate(indices):
        if isinstance(x, bool) or not isinstance(x, Integral) or int(x) < 0:
            raise UsageError(f"sequence {i}: index {x!r} is not an integer >= 0")
        if int(x) in seen:  # two sequences would draw one stream
            raise UsageError(f"sequences {seen[int(x)]} and {i} have the same index {x}")
        seen[int(x)] = i
    return list(seen)


class BatchRows:
    """Which sequence each row of a running batch holds, the tokens each has made and why it ends,
    and when the batch compacts: the bookkeeping of `run_batch`, pure (no model, no workers).

    Rows are the live sequences rounded up to a power of two; a finished sequence's row stays as
    padding (None) until the live count falls to the next lower power of two (`compaction`).
    """

    def __init__(
        self, maxes: Sequence[int], ends: SamplingParams, stop_ids: Sequence[Sequence[int]] | None = None
    ):
        self.maxes = list(maxes)
        # per sequence: the request's stop ids (`ends`) and its own
        self.ends = [
            replace(ends, stop_ids=ends.stop_ids + tuple(own)) if own else ends
            for own in (stop_ids if stop_ids is not None else [()] * len(self.maxes))
        ]
        if len(self.ends) != len(self.maxes):
            raise ValueError(f"{len(self.ends)} stop-id lists for {len(self.maxes)} sequences")
        self.new: list[list[int]] = [[] for _ in maxes]
        self.done: dict[int, FinishReason] = {i: FinishReason.LENGTH for i, m in enumerate(maxes) if m == 0}
        live = [i for i in range(len(maxes)) if i not in self.done]
        self.rows: list[int | None] = live + [None] * ((pow2(len(live)) if live else 0) - len(live))

    def live(self) -> list[int]:
        """The rows holding an unfinished sequence."""
        return [r for r, s in enumerate(self.rows) if s is not None]

    def advance(self, tokens: Sequence[int]) -> list[tuple[int, int, FinishReason | None]]:
        """Each live row's new token (in `live()` order) appended to its sequence: per row,
        (sequence, token, why it ended or None); an ended sequence's row becomes padding."""
        out = []
        for r, t in zip(self.live(), tokens, strict=True):
            s = self.rows[r]
            assert s is not None
            self.new[s].append(t)
            why = finish_reason(t, len(self.new[s]), self.maxes[s], self.ends[s])
            if why is not None:
                self.done[s] = why
                self.rows[r] = None
            out.append((s, t, why))
        return out

    def compaction(self) -> list[int | None] | None:
        """When the live rows fit in a lower power of two: the old row of each new row (None:
        padding), applied here; else None."""
        live = self.live()
        if not live or pow2(len(live)) >= len(self.rows):
            return None
        keep: list[int | None] = [*live, *[None] * (pow2(len(live)) - len(live))]
        self.rows = [None if r is None else self.rows[r] for r in keep]
        return keep

    def tokens(self) -> list[int]:
        """What each row feeds next: its sequence's last token (0 for padding)."""
        return [0 if s is None else self.new[s][-1] for s in self.rows]


def run_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    sampling: SamplingParams | None = None,
    stop_ids: Sequence[Sequence[int]] | None = None,
    indices: Sequence[int] | None = None,
    stop_at_eos: bool = True,
    micro: int | str = "auto",
    on_finish: Callable[[SequenceOutput], None] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    timeout: float | None = None,
    prefill_logits: bool = False,
    steps_per_call: int = STEPS_PER_CALL,
) -> BatchGeneration:
    """`LlamaModel.run_generate_batch` (see there); `prefill_logits` keeps each prompt's
    last-token logits (`BatchGeneration.prefill_logits`)."""
    steps = check_steps_per_call(steps_per_call)
    cfg = model.config
    ids = check_prompts(prompts, cfg.vocab)
    maxes = check_max_new(max_new_tokens, len(ids))
    own_stops = check_stop_ids(stop_ids, len(ids), cfg.vocab)
    seeds = check_indices(indices, len(ids))
    fixed = check_micro(micro)  # the caller's micro-batch count, or None: the plans choose per step

    def split(kind: str, rows: int, blocks: int) -> int:
        extra = (stop_width(book.ends),) if kind == "batch_decode" else ()  # its graph samples
        return int(model.choose_micro(kind, rows, blocks, extra)) if fixed is None else min(fixed, rows)

    params = check_sampling(sampling, cfg.vocab)
    own = samplers(params, seeds) if params.do_sample else []
    ends = replace(params, stop_ids=tuple(params.stop_ids) + (tuple(cfg.eos) if stop_at_eos else ()))
    planned, nplans = model.planning_s, len(model.plans)
    model.plan_batch_ahead(ids, maxes, fixed)  # a run that cannot finish fails before its first token
    book = BatchRows(maxes, ends, own_stops)
    done: dict[int, SequenceOutput] = {}

    def finish(i: int) -> None:
        done[i] = SequenceOutput(i, ids[i], list(book.new[i]), book.done[i].value)
        if on_finish is not None:
            on_finish(done[i])

    for i in sorted(book.done):  # max_new_tokens 0: done before anything runs
        finish(i)
    R = len(book.rows)
    gen = BatchGeneration([], R, 1 if fixed is None else min(fixed, R) if R else fixed)
    layout = BatchLayout.of([len(ids[s]) for s in book.rows if s is not None] or [1], model.block, R)
    reached, rows0, ok = layout.blocks, R, False
    try:
        if R:
            gen.micro = split("batch_prefill", R, layout.blocks)
            logits = _prefill(model, gen, layout, [ids[s] for s in book.rows if s is not None], R, timeout)
            if prefill_logits:
                gen.prefill_logits = _per_prompt(logits, [s for s in book.rows if s is not None], len(ids))
        p = layout.length  # the cache index of the next token fed
        if book.live():  # the first new tokens, from the prefill's logits, chosen here
            live = book.live()
            named = [seeds[book.rows[r]] for r in live]  # type: ignore[index]  # each row's `indices` entry
            draws = [own[book.rows[r]] for r in live] if own else ()  # type: ignore[index]
            picked = sample(logits[live], params, draws, step=0, rows=named)
            first = dict(zip(live, picked.tolist()))
            advance(book, [[first.get(r, 0) for r in range(R)]], on_token, finish)
        width = stop_width(book.ends)
        while book.live():
            keep = book.compaction()
            if keep is not None:  # live rows to 0..B'-1 on the workers, the rest dropped
                _compact(model, keep, R, reached)
                layout, R = layout.take(keep), len(keep)
            model._poll_budget()  # between calls: a new capacity takes effect here
            blocks = p // model.block + 1
            reached = max(reached, blocks)
            m = split("batch_decode", R, blocks)  # chosen once per (rows, blocks, capacity)
            left = [book.maxes[s] - len(book.new[s]) for s in (book.rows[r] for r in book.live())]  # type: ignore[index]
            k = steps_in_call(steps, p, model.block, left)
            toks, dt, moved = decode_call(
                model,
                book,
                layout,
                p,
                (R, blocks, m, width),
                k,
                params,
                own,
                timeout,
                len(gen.decode_s),
                seeds,
                lambda t: advance(book, [t.tolist()], on_token, finish, own),  # as the worker makes them
            )
            n = len(toks)
            gen.decode_s += [dt / n] * n  # each step's share of the call
            gen.rows += [R] * n
            gen.micros += [m] * n
            gen.bytes_loaded += moved
            p += n
        ok = True
    finally:  # the batch's KV cache goes, whatever happened
        _drop_cache(model, rows0, reached, ok)
    gen.sequences = [done[i] for i in range(len(ids))]
    gen.planning_s = model.planning_s - planned
    gen.plans_made = len(model.plans) - nplans
    return gen


def check_micro(micro: object) -> int | None:
    """`micro=`: a power of two >= 1 (the caller's micro-batch count), or "auto": None."""
    if micro == "auto":
        return None
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1 or micro & (micro - 1):
        raise UsageError(f"micro must be a power of two >= 1 or 'auto', got {micro!r}")
    return micro


def check_sampling(sampling: object, vocab: int) -> SamplingParams:
    """`sampling=` checked against the vocabulary (None: greedy), with a seed when it samples."""
    params = sampling if sampling is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise UsageError(f"sampling must be a SamplingParams, got {type(params).__name__}")
    params.validate(vocab)
    if params.do_sample:
        params = params.with_seed()
    return params


def _prefill(
    model: Any,
    gen: BatchGeneration,
    layout: BatchLayout,
    prompts: list[list[int]],
    rows: int,
    timeout: float | None,
) -> torch.Tensor:
    """The live prompts prefilled together in one run of `gen.micro` micro-batches: the logits
    of each row's last token; the run's time and bytes loaded go to `gen`."""
    m = gen.micro
    mgraph, prog = model._program(("batch_prefill", rows, layout.blocks, m))
    feed = feed_prefill(mgraph, model.config, layout, prompts, m)
    outs, gen.prefill_s = _run(prog, feed, model.check, timeout)
    gen.prefill_bytes_loaded = _loaded(prog)
    return mgraph.gather(outs)


def _per_prompt(logits: torch.Tensor, seqs: list[int], n: int) -> torch.Tensor:
    """The prefill's logits rows (of sequences `seqs`) as one row per prompt of `n`: the sequences
    with no new tokens were not prefilled, their rows are NaN."""
    out = torch.full((n, logits.shape[1]), float("nan"))
    out[seqs] = logits[: len(seqs)]
    return out


def _drop_cache(model: Any, rows: int, blocks: int, ok: bool) -> None:
    """The batch's KV cache states (`rows` rows, `blocks` cache blocks) dropped on the workers;
    a failure to drop them is raised only when the run itself went well (`ok`)."""
    cfg = model.config
    try:
        model.pool.move_states({}, [x for r in range(rows) for x in state_ids(cfg, model.gpus, r, blocks)])
    except Exception:
        if ok:  # else the run's own error is the one to see (the workers may be gone)
            raise


def _run(prog, feed: dict[str, torch.Tensor], check: bool, timeout: float | None) -> tuple[dict, float]:
    t = time.perf_counter()
    outs = prog.run(feed, check=check, timeout=timeout)
    return outs, time.perf_counter() - t


def _loaded(prog) -> int:
    """Bytes the last run loaded into the arenas: inputs (skipped loads excluded) and reloads."""
    moved = (prog.last_summary or {}).get("bytes", {})
    return int(moved.get("input", 0) + moved.get("reload", 0))


def _compact(model: Any, keep: list[int | None], rows: int, blocks: int) -> None:
    """Row keep[i] becomes row i on every worker; the other rows' KV cache states are dropped."""
    cfg, G = model.config, model.gpus
    renames: dict[str, str] = {}
    for i, r in enumerate(keep):
        if r is not None and r != i:
            renames.update(zip(state_ids(cfg, G, r, blocks), state_ids(cfg, G, i, blocks)))
    kept = {r for r in keep if r is not None}
    drop = [x for r in range(rows) if r not in kept for x in state_ids(cfg, G, r, blocks)]
    model.pool.move_states(renames, drop)  # type: ignore[attr-defined]
