"""Token choice (disco_ray/models/sampling.py) against transformers' warpers, with no Ray.

The processed logits equal transformers' TemperatureLogitsWarper -> TopKLogitsWarper ->
TopPLogitsWarper bit for bit (ties and -inf included); sampled frequencies pass a chi-square test
against softmax of them; a sequence's tokens depend on its seed and index only; greedy is argmax.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disco_ray.graph.errors import UsageError
from disco_ray.models.sampling import (
    FinishReason,
    SamplingParams,
    SequenceSampler,
    finish_reason,
    process_logits,
    sample,
    samplers,
)

transformers_lp = pytest.importorskip("transformers.generation.logits_process")


def oracle(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """What transformers' generate applies with do_sample=True (generation/utils.py's conditions)."""
    warpers = transformers_lp.LogitsProcessorList()
    if p.temperature != 1.0:
        warpers.append(transformers_lp.TemperatureLogitsWarper(float(p.temperature)))
    if p.top_k != 0:
        warpers.append(transformers_lp.TopKLogitsWarper(top_k=p.top_k))
    if p.top_p < 1.0:
        warpers.append(transformers_lp.TopPLogitsWarper(top_p=p.top_p))
    return warpers(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone())


def logits_of(kind: str, batch: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(batch, vocab, generator=g) * 3
    if kind == "ties":  # few distinct values: ties at every top-k and top-p boundary
        return torch.randint(-3, 3, (batch, vocab), generator=g).float()
    x = torch.randn(batch, vocab, generator=g)  # "masked": some tokens already -inf
    return x.masked_fill(torch.rand(batch, vocab, generator=g) < 0.3, -math.inf)


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.dtype == torch.float32, what
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), f"{what}: different tokens filtered"
    assert torch.equal(ours, theirs), f"{what}: different values"
    assert torch.equal(ours.softmax(-1), theirs.softmax(-1)), f"{what}: different distributions"


@pytest.mark.parametrize("kind", ["normal", "ties", "masked"])
@pytest.mark.parametrize("vocab", [1, 7, 50, 1000])
def test_the_processed_logits_equal_transformers_warpers(kind, vocab):
    logits = logits_of(kind, 6, vocab, seed=vocab)
    if kind == "masked":
        logits[:, 0] = 0.0  # a row with every token at -inf has no distribution
    temperatures = [0.3, 1.0, 1.7]
    top_ks = sorted({0, 1, 3, max(vocab - 1, 1), vocab, vocab + 5})
    top_ps = [0.05, 0.5, 0.9, 0.999, 1.0]
    for t, k, p in itertools.product(temperatures, top_ks, top_ps):
        params = SamplingParams(do_sample=True, temperature=t, top_k=k, top_p=p)
        assert_same(process_logits(logits, params), oracle(logits, params), f"{kind} V={vocab} {params}")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    batch=st.integers(1, 5),
    vocab=st.integers(1, 300),
    seed=st.integers(0, 2**31),
    kind=st.sampled_from(["normal", "ties", "masked"]),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 320),
    top_p=st.floats(0.01, 1.0),
)
def test_random_params_equal_transformers_warpers(batch, vocab, seed, kind, temperature, top_k, top_p):
    logits = logits_of(kind, batch, vocab, seed)
    logits[:, 0] = 0.0
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    assert_same(process_logits(logits, params), oracle(logits, params), str(params))


def test_top_k_keeps_every_tie_and_top_p_keeps_the_most_likely_token():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0]])
    kept = ~torch.isinf(process_logits(x, SamplingParams(top_k=2)))
    assert kept.tolist() == [[False, True, False, True, False]]
    kept = ~torch.isinf(process_logits(x, SamplingParams(top_k=3)))
    assert kept.tolist() == [[False, True, True, True, True]]
    one = process_logits(torch.tensor([[0.0, 10.0, 0.0]]), SamplingParams(top_p=1e-6))
    assert (~torch.isinf(one)).tolist() == [[False, True, False]]


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against `probs` over the tokens of nonzero probability.

    The upper tail of chi-square with d degrees of freedom at s is Q(d/2, s/2) (torch.special.gammaincc).
    """
    n = counts.sum().item()
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    keep = probs > 0
    expected = probs[keep].double() * n
    assert expected.min() >= 5, "too few draws for a chi-square test"
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


CASES = [
    SamplingParams(do_sample=True, temperature=0.6),
    SamplingParams(do_sample=True, temperature=1.4, top_k=5),
    SamplingParams(do_sample=True, top_p=0.8),
    SamplingParams(do_sample=True, temperature=0.9, top_k=7, top_p=0.85),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_sampled_frequencies_over_many_seeds_pass_a_chi_square_test(params):
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(7))
    probs = process_logits(logits, params).softmax(-1)[0]
    draws = 20_000
    # one sequence per seed (index 3 of its request), its first token
    tokens = torch.cat([sample(logits, params, samplers(SamplingParams(seed=s), [3])) for s in range(draws)])
    counts = torch.bincount(tokens, minlength=12)
    assert p_value(counts, probs) > 1e-3, f"{params}: {counts.tolist()} against {probs.tolist()}"
    # The test can tell: the unprocessed distribution is rejected by the same draws.
    raw = logits.softmax(-1)[0]
    assert counts[raw > 0].sum() == draws and p_value_raw(counts, raw) < 1e-6


def p_value_raw(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64), stat / 2))


def test_one_sequences_successive_tokens_follow_the_distribution():
    params = SamplingParams(do_sample=True, temperature=1.2, top_k=6, top_p=0.9, seed=11)
    logits = torch.randn(1, 9, generator=torch.Generator().manual_seed(3))
    probs = process_logits(logits, params).softmax(-1)[0]
    (one,) = samplers(params, [0])
    tokens = torch.cat([sample(logits, params, [one]) for _ in range(20_000)])
    assert one.statistics() == {"seed": 11, "index": 0, "draws": 20_000}
    assert p_value(torch.bincount(tokens, minlength=9), probs) > 1e-3


def test_a_sequences_tokens_do_not_depend_on_its_batch_nor_its_order():
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    n, steps, vocab = 6, 8, 64
    g = torch.Generator().manual_seed(5)
    # step s's logits of sequence i (ties included), whatever batch it is in
    rows = torch.randint(-4, 4, (steps, n, vocab), generator=g).float() + torch.rand(steps, n, 1, generator=g)

    def run(batches: list[list[int]]) -> dict[int, list[int]]:
        own = dict(zip(range(n), samplers(params, range(n)), strict=True))
        out: dict[int, list[int]] = {i: [] for i in range(n)}
        for s in range(steps):
            for b in batches:
                tokens = sample(rows[s, b], params, [own[i] for i in b])
                for i, t in zip(b, tokens.tolist(), strict=True):
                    out[i].append(t)
        return out

    alone = run([[i] for i in range(n)])
    assert len({tuple(v) for v in alone.values()}) == n, "two sequences of one request drew the same stream"
    assert run([list(range(n))]) == alone
    assert run([list(reversed(range(n)))]) == alone
    assert run([[4, 1], [0, 5, 3], [2]]) == alone
    again = SamplingParams(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    assert run([[5, 0, 2, 1, 4, 3]]) == alone and params == again
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=1235)
    assert run([list(range(n))]) != alone, "another seed gave the same tokens"


def test_with_seed_fixes_a_seed_once_and_keeps_a_given_one():
    assert SamplingParams(seed=9).with_seed().seed == 9
    torch.manual_seed(0)
    a = SamplingParams(do_sample=True).with_seed()
    torch.manual_seed(0)
    assert a == SamplingParams(do_sample=True).with_seed() and a.seed is not None
    with pytest.raises(ValueError, match="with_seed"):
        samplers(SamplingParams(), [0])
    assert SequenceSampler(1, 0).uniform() != SequenceSampler(0, 1).uniform()


def test_greedy_is_argmax_with_the_lowest_id_on_ties_and_draws_nothing():
    logits = torch.randint(-2, 2, (16, 10), generator=torch.Generator().manual_seed(2)).float()
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))
    tied = torch.tensor([[0.0, 5.0, 1.0, 5.0], [7.0, 7.0, 7.0, 7.0]])
    assert sample(tied, SamplingParams(temperature=0.5, top_k=1)).tolist() == [1, 0]
    own = samplers(SamplingParams(seed=1), range(16))
    sample(logits, SamplingParams(seed=1), own)
    assert all(s.draws == 0 for s in own)
    assert sample(logits.half(), SamplingParams()).tolist() == logits.argmax(-1).tolist()


def test_stop_ids_end_a_sequence():
    p = SamplingParams(stop_ids=(2, 7))
    assert p.stops(7) and not p.stops(3)
    assert finish_reason(2, 1, 5, p) is FinishReason.STOP
    assert finish_reason(2, 5, 5, p) is FinishReason.STOP
    assert finish_reason(3, 5, 5, p) is FinishReason.LENGTH
    assert finish_reason(3, 4, 5, p) is None


@pytest.mark.parametrize(
    ("params", "vocab", "words"),
    [
        (
            SamplingParams(do_sample=True, temperature=0.0),
            None,
            "temperature must be > 0 when sampling, got 0.0",
        ),
        (
            SamplingParams(do_sample=True, temperature=-1),
            None,
            "temperature must be > 0 when sampling, got -1",
        ),
        (SamplingParams(temperature=math.nan), None, "temperature must be a finite number, got nan"),
        (SamplingParams(top_k=-1), None, "top_k must be an integer >= 0 (0: off), got -1"),
        (SamplingParams(top_k=2.5), None, "top_k must be an integer >= 0 (0: off), got 2.5"),
        (SamplingParams(top_p=0.0), None, "top_p must be in (0, 1], got 0.0"),
        (SamplingParams(top_p=1.5), None, "top_p must be in (0, 1], got 1.5"),
        (SamplingParams(top_p=math.nan), None, "top_p must be in (0, 1], got nan"),
        (SamplingParams(seed=-3), None, "seed must be an integer in [0, 2**64), got -3"),
        (SamplingParams(stop_ids=(1, -2)), None, "stop id -2 is not a token id (an integer >= 0)"),
        (
            SamplingParams(stop_ids=(1, 32000)),
            32000,
            "stop id 32000 is outside the vocabulary of 32000 tokens",
        ),
    ],
)
def test_bad_params_give_one_line_usage_errors(params, vocab, words):
    with pytest.raises(UsageError) as e:
        params.validate(vocab)
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)
    if vocab is None:
        with pytest.raises(UsageError, match="^" + re.escape(words)):
            sample(torch.zeros(1, 4), params, samplers(SamplingParams(seed=0), [0]))


def test_greedy_accepts_a_temperature_of_zero_but_processing_refuses_it():
    SamplingParams(temperature=0.0).validate()
    with pytest.raises(UsageError, match="temperature must be > 0 to process logits"):
        process_logits(torch.zeros(1, 3), SamplingParams(temperature=0.0))


def test_logits_must_be_rows():
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        sample(torch.zeros(4), SamplingParams())
    with pytest.raises(ValueError, match="2 rows of logits but 1 samplers"):
        sample(
            torch.zeros(2, 4), SamplingParams(do_sample=True, seed=0), samplers(SamplingParams(seed=0), [0])
        )
