"""Several decode steps per call (`steps_per_call`, disco_ray/models/decode_calls.py), tokens chosen
on the device: the tokens, the streamed order and the per-step statistics of steps_per_call=8
equal those of one step per call, greedy (= transformers' per prompt) and sampled with a seed, on
1 and 2 GPUs, both engines, at a roomy and an offloading capacity; sequences stop at different
steps (stop ids, maxima) and cross cache-block boundaries, where a call never spans two blocks.
"""

from __future__ import annotations

import pytest

from disco_ray.driver.program import Program
from disco_ray.graph.errors import UsageError
from disco_ray.models import LlamaModel
from disco_ray.models.decode_calls import steps_in_call, stop_width
from disco_ray.models.sampling import SamplingParams
from tests.ray_fixtures import pool  # noqa: F401  (module fixture for the ray test)
from tests.test_batch_generate import BLOCK, MAX_NEW, PROMPTS, capacity, ckpt, free, own_stop  # noqa: F401

SAMPLED = SamplingParams(do_sample=True, temperature=1.3, top_k=50, top_p=0.9, seed=11)


@pytest.fixture
def calls(monkeypatch) -> list[tuple[int, int, int]]:
    """Each run_steps call: (cache index of its first step, steps asked, steps done)."""
    seen: list[tuple[int, int, int]] = []
    run_steps = Program.run_steps

    def spy(self, feeds, **kw):
        out = run_steps(self, feeds, **kw)
        seen.append((int(feeds[0]["pos_g0"]), len(feeds), len(out)))
        return out

    monkeypatch.setattr(Program, "run_steps", spy)
    return seen


def generate(m, k: int, **kw) -> tuple[object, list[tuple[int, int]]]:
    streamed: list[tuple[int, int]] = []
    g = m.run_generate_batch(
        PROMPTS, MAX_NEW, steps_per_call=k, on_token=lambda s, t: streamed.append((s, t)), **kw
    )
    return g, streamed


def check_calls(calls: list[tuple[int, int, int]], steps: int) -> None:
    """Every step ran in a call of several where it could, none across a cache block."""
    assert sum(done for _, _, done in calls) == steps
    assert any(done > 1 for _, _, done in calls) and len(calls) < steps
    for p, asked, done in calls:
        assert 1 <= done <= asked <= 8 and p // BLOCK == (p + asked - 1) // BLOCK


@pytest.mark.parametrize("gpus, mode", [(1, "roomy"), (2, "roomy"), (1, "tight"), (2, "tight")])
def test_eight_steps_per_call_give_the_tokens_of_one_on_the_local_engine(ckpt, free, calls, gpus, mode):  # noqa: F811
    path, _ = ckpt
    stop, k = own_stop(free)
    with LlamaModel(path, gpus=gpus, capacity=capacity(path, gpus, mode), block=BLOCK, engine="local") as m:
        greedy, order = generate(m, 8, stop_ids=[[], [], [stop]], stop_at_eos=False)
        check_calls(calls, len(greedy.decode_s))
        assert [s.new_ids for s in greedy.sequences] == [free[0], free[1], free[2][:k]]  # transformers'
        one, order1 = generate(m, 1, stop_ids=[[], [], [stop]], stop_at_eos=False)
        assert order == order1  # streamed per token, in the same order
        assert [s.new_ids for s in one.sequences] == [s.new_ids for s in greedy.sequences]
        assert (greedy.rows, greedy.micros) == (one.rows, one.micros)
        # a later step of a call loads no sampling parameters nor stop ids: the worker holds them
        assert all(a <= b for a, b in zip(greedy.bytes_loaded, one.bytes_loaded, strict=True))
        sampled8 = m.run_generate_batch(PROMPTS, MAX_NEW, sampling=SAMPLED, steps_per_call=8)
        sampled1 = m.run_generate_batch(PROMPTS, MAX_NEW, sampling=SAMPLED, steps_per_call=1)
        assert [s.new_ids for s in sampled8.sequences] == [s.new_ids for s in sampled1.sequences]
        assert [s.finish_reason for s in sampled8.sequences] == [s.finish_reason for s in sampled1.sequences]
        assert (
            len(sampled8.decode_s)
            == len(sampled8.rows)
            == len(sampled8.bytes_loaded)
            == len(sampled1.decode_s)
        )


@pytest.mark.ray
@pytest.mark.parametrize("gpus, mode", [(1, "roomy"), (1, "tight"), (2, "roomy")])
def test_eight_steps_per_call_give_the_tokens_of_one_on_the_ray_engine(ckpt, free, pool, calls, gpus, mode):  # noqa: F811
    path, _ = ckpt
    stop, k = own_stop(free)
    cap = capacity(path, gpus, mode)
    with LlamaModel(path, gpus=gpus, capacity=cap, block=BLOCK, engine="ray", pool=pool) as m:
        before = pool.state_count()
        g, _ = generate(m, 8, stop_ids=[[], [], [stop]], stop_at_eos=False)
        assert [s.new_ids for s in g.sequences] == [free[0], free[1], free[2][:k]]
        check_calls(calls, len(g.decode_s))
        sampled8 = m.generate(PROMPTS, MAX_NEW, sampling=SAMPLED, steps_per_call=8)
        sampled1 = m.generate(PROMPTS, MAX_NEW, sampling=SAMPLED, steps_per_call=1)
        assert sampled8 == sampled1
        assert pool.state_count() == before  # the batch's KV cache is gone with it


def test_the_steps_of_a_call_stay_in_a_cache_block_and_within_the_closest_maximum():
    assert steps_in_call(8, 72, 4, [5, 9]) == 4  # the block of index 72 ends at 75
    assert steps_in_call(8, 74, 4, [5, 9]) == 2
    assert steps_in_call(8, 64, 64, [3, 9]) == 3  # the live sequence closest to its maximum
    assert steps_in_call(1, 64, 64, [3, 9]) == 1
    assert stop_width([SamplingParams(stop_ids=(1, 2))]) == 4
    assert stop_width([SamplingParams(stop_ids=tuple(range(5)))]) == 8


def test_steps_per_call_must_be_a_positive_integer(ckpt):  # noqa: F811
    path, _ = ckpt
    with LlamaModel(path, capacity=1 << 24, block=BLOCK, engine="local") as m:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(UsageError, match="steps_per_call must be an integer >= 1"):
                m.run_generate_batch(PROMPTS, 2, steps_per_call=bad)
