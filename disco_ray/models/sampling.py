"""Choosing the next token from a batch of logits: greedy, or sampling as transformers does.

`process_logits` applies temperature, then top-k, then top-p, in transformers' order and with its
warpers' semantics (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` with
`min_tokens_to_keep=1` and filter value -inf). `sample` draws one token per row; each sequence
owns a `SequenceSampler` whose generator is seeded from (request seed, the sequence's index in the
request) and advances once per generated token, so a sequence's tokens never depend on which other
sequences share its batch, nor on their order.

The rows are whole: top-k and top-p need the order of the full vocabulary, so logits that are
sharded over the vocabulary (one block of columns per GPU) are gathered first. The math is
`disco_ray.graph.kernels_sample`'s, shared with the `sample_tokens` op: a batch's decode graph
samples on the device that holds the gathered logits, with the u each sequence's sampler gives
(`peek`), and the driver samples the prefill's logits with the same code.

Every row sampled from is checked first (`check_logits`, and the op's own check): a NaN or
infinite logit ends the generation with an error naming the step and the sequence, never a token.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from disco_ray.graph.errors import NonFiniteError, UsageError
from disco_ray.graph.kernels_sample import pick, process_rows

_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below this


class FinishReason(enum.Enum):
    """Why a sequence ended."""

    STOP = "stop"  # it produced one of its stop ids
    LENGTH = "length"  # it reached its max new tokens


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request chooses its tokens (the same for every sequence of the request)."""

    do_sample: bool = False  # False: greedy (argmax), the other fields but stop_ids are ignored
    temperature: float = 1.0  # > 0; logits are divided by it
    top_k: int = 0  # keep the k most likely tokens (ties at the k-th value kept); 0: off
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1: off
    seed: int | None = None  # None: drawn from torch's global generator by with_seed()
    stop_ids: tuple[int, ...] = ()  # tokens that end a sequence (the caller adds its EOS ids)

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field; `vocab_size` also bounds the stop ids.

        Raises:
            UsageError: one line naming the field and its value.
        """
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise UsageError(f"temperature must be a finite number, got {t!r}")
        if self.do_sample and t <= 0:
            raise UsageError(f"temperature must be > 0 when sampling, got {t}; for greedy turn sampling off")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UsageError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < _SEED_LIMIT):
            raise UsageError(f"seed must be an integer in [0, 2**64), got {s!r}")
        for i in self.stop_ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise UsageError(f"stop id {i!r} is not a token id (an integer >= 0)")
            if vocab_size is not None and i >= vocab_size:
                raise UsageError(f"stop id {i} is outside the vocabulary of {vocab_size} tokens")

    def with_seed(self) -> SamplingParams:
        """These params with a concrete seed: a request draws it once, before its first sequence."""
        if self.seed is not None:
            return self
        return replace(self, seed=int(torch.randint(0, 2**63 - 1, ()).item()))

    def stops(self, token: int) -> bool:
        """Whether `token` ends the sequence that produced it."""
        return token in self.stop_ids


def finish_reason(
    token: int, new_tokens: int, max_new_tokens: int, params: SamplingParams
) -> FinishReason | None:
    """Why a sequence ends after producing `token` as its `new_tokens`-th new token, or None if it goes on."""
    if params.stops(token):
        return FinishReason.STOP
    return FinishReason.LENGTH if new_tokens >= max_new_tokens else None


class SequenceSampler:
    """One sequence's random stream: seeded from (request seed, index), one draw per generated token."""

    def __init__(self, seed: int, index: int) -> None:
        self.seed = seed
        self.index = index
        self.draws = 0
        # Hashed, so that nearby (seed, index) pairs give unrelated streams.
        digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
        self._generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        self._ahead: list[float] = []  # numbers drawn by `peek`, not used yet

    def uniform(self) -> float:
        """The next number of the stream, uniform in [0, 1)."""
        self.draws += 1
        if self._ahead:
            return self._ahead.pop(0)
        return float(torch.rand((), generator=self._generator, dtype=torch.float64))

    def peek(self, n: int) -> list[float]:
        """The next `n` numbers of the stream, left for `uniform` (a call of several decode steps
        hands them to the device; the steps it did not run leave the stream where it was)."""
        while len(self._ahead) < n:
            self._ahead.append(float(torch.rand((), generator=self._generator, dtype=torch.float64)))
        return self._ahead[:n]

    def skip(self, n: int) -> None:
        """Uses the next `n` numbers (drawn by `peek`) as `uniform` would."""
        for _ in range(n):
            self.uniform()

    def statistics(self) -> dict[str, int]:
        """Its seed, its index in the request and how many numbers it has drawn."""
        return {"seed": self.seed, "index": self.index, "draws": self.draws}


def samplers(params: SamplingParams, indices: Iterable[int]) -> list[SequenceSampler]:
    """A sampler per sequence index of a request whose seed is set (`SamplingParams.with_seed`)."""
    if params.seed is None:
        raise ValueError("samplers need a concrete seed: call params.with_seed() once per request")
    return [SequenceSampler(params.seed, i) for i in indices]


def _check_rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [batch, vocab] with vocab > 0, got shape {tuple(logits.shape)}")
    return logits.to(torch.float32)


def check_logits(
    logits: torch.Tensor, step: int | None = None, rows: Sequence[int] | None = None, row: str = "sequence"
) -> None:
    """NonFiniteError unless every logit of `logits` [rows, vocab] is finite.

    Args:
        logits: the rows a step samples from.
        step: the generation step (0: the prefill's logits), named in the message.
        rows: each row's index as the caller names it (default 0..n-1): a sequence's index
            in its request (`indices=`, a line of a prompts file), a prompt's position.
        row: what a row is ("sequence"; "position" for a prompt's logits).
    """
    bad = ~torch.isfinite(logits).all(dim=-1)
    if not bool(bad.any()):
        return
    r = int(bad.nonzero()[0])
    x = logits[r]
    name = rows[r] if rows is not None else r
    when = "" if step is None else "the prefill: " if step == 0 else f"decode step {step}: "
    raise NonFiniteError(
        f"{when}the logits of {row} {name} hold {int(torch.isnan(x).sum())} NaN and "
        f"{int(torch.isinf(x).sum())} infinite values of {x.numel()} ({int(bad.sum())} of the "
        f"{logits.shape[0]} rows have some): no token is sampled from them"
    )


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (transformers' order); filtered tokens get -inf.

    Args:
        logits: [batch, vocab], cast to float32 as transformers does before its processors.
        params: the request's params; `do_sample` is not looked at (greedy does not process).

    Returns:
        A new [batch, vocab] float32 tensor; softmax of it is the distribution `sample` draws from.
    """
    params.validate()
    if params.temperature <= 0:
        raise UsageError(f"temperature must be > 0 to process logits, got {params.temperature}")
    return process_rows(_check_rows(logits), params.temperature, params.top_k, params.top_p)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    seq_samplers: Sequence[SequenceSampler] = (),
    *,
    step: int | None = None,
    rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """The next token of each row: argmax when greedy, else one draw from softmax(process_logits).

    Args:
        logits: [batch, vocab] full rows, gathered on the driver (see the module's docstring).
        params: the request's params.
        seq_samplers: row i's sampler (greedy needs none); each advances by one draw.
        step, rows: the generation step and each row's sequence index, for `check_logits`.

    Returns:
        [batch] int64 token ids. Greedy picks the lowest id among tied maxima, as torch.argmax.

    Raises:
        NonFiniteError: a row holds a NaN or infinite logit (naming the step and its sequence).
    """
    rows32 = _check_rows(logits)
    check_logits(rows32, step, rows)
    if not params.do_sample:
        params.validate()
        return pick(rows32, None, 0.0, 0, 1.0)
    params.validate()
    if params.temperature <= 0:
        raise UsageError(f"temperature must be > 0 to process logits, got {params.temperature}")
    if len(seq_samplers) != rows32.shape[0]:
        raise ValueError(f"{rows32.shape[0]} rows of logits but {len(seq_samplers)} samplers")
    # one uniform per row, so a row's token depends on its own stream only
    u = torch.tensor([s.uniform() for s in seq_samplers], dtype=torch.float64)
    return pick(rows32, u, params.temperature, params.top_k, params.top_p)
