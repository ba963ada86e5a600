"""A carried KV block saves only the rows its step wrote and stays in the arena for the next
step (actors/carries.py): the tokens stay transformers' greedy ones, and a decode step after
the first of a cache block skips the load of that block, which the previous step left in place."""

from __future__ import annotations

import pytest

from actors.executor import Executor
from disco_ray.models import LlamaModel
from tests.test_batch_generate import BLOCK, MAX_NEW, PROMPTS, capacity, ckpt, free  # noqa: F401


@pytest.mark.parametrize("k", [1, 8])
def test_a_decode_step_keeps_its_cache_blocks_in_the_arena_and_its_tokens(ckpt, free, monkeypatch, k):  # noqa: F811
    path, _ = ckpt
    kept_loads: list[tuple[int, int]] = []  # per run: (kept loads skipped, kept loads)
    begin = Executor.begin

    def spy(self, *a, **kw):
        begin(self, *a, **kw)
        kept = {where for x in self._saves.mirrors.values() for where, _, _ in x}
        skipped = {(self.plans[v].out_loc.offset, self.plans[v].out_loc.nbytes) for v in self._skip}
        kept_loads.append((len(kept & skipped), len(kept)))

    monkeypatch.setattr(Executor, "begin", spy)
    with LlamaModel(path, gpus=1, capacity=capacity(path, 1, "roomy"), block=BLOCK, engine="local") as m:
        g = m.run_generate_batch(PROMPTS, MAX_NEW, steps_per_call=k, stop_at_eos=False)
    assert [s.new_ids for s in g.sequences] == free  # transformers' greedy tokens
    # a step within a block after its first reads every current block from where the last left it
    assert any(n == of > 0 for n, of in kept_loads), kept_loads


def test_with_launch_ahead_a_kernel_never_waits_on_a_load_completed_in_place(ckpt, free):  # noqa: F811
    # launch ahead (ahead=2 on the cpu backend) may queue a kernel behind a load launched in the
    # same pass: such a load must run on its lane (completed in place, it never finished: a hang)
    path, _ = ckpt
    with LlamaModel(
        path, gpus=1, capacity=capacity(path, 1, "roomy"), block=BLOCK, engine="local", ahead=2
    ) as m:
        got = m.generate(PROMPTS, MAX_NEW, steps_per_call=8, stop_at_eos=False, timeout=120)
    assert got == free
