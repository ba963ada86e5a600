"""Soak (issue #30, item 8): one Ray pool serves 50 generate requests of 100 tokens one after
another, then 4 at once from threads, then 20 LoRA fine-tuning steps, with the disk tier in use.

The workers' resident memory, open file descriptors and threads after the first request and after
the last differ by at most 5% (a leak per request would grow them), the spill directory is empty
once the model and the trainer are closed, and every request's tokens equal a fresh pool's: the
threads' requests wait their turn on the pool (`RayPool.lock`) instead of mixing their runs and
KV caches. A quick test checks the same of threads on the local engine.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from disco_ray.models.finetune import LoraTrainer  # noqa: E402
from disco_ray.models.llama import LlamaModel  # noqa: E402
from tests.ray_fixtures import local_ray  # noqa: E402
from tests.test_models import make_checkpoint  # noqa: E402
from workloads.llm.train import LoraSpec, OptimSpec  # noqa: E402

ray = pytest.importorskip("ray")

PROMPTS = [[5, 17, 3, 99], [1, 2, 3], [7, 7, 7, 7, 7, 7, 7], [100, 4], [60, 61, 62, 63, 64]]
NEW = 100  # tokens per request
# a tight arena and a small host budget: prefill and some decode steps offload to the spill file
MODEL = dict(gpus=1, capacity="60KiB", block=16, host_capacity="8KiB")
TRAIN_CAPACITY = "500KiB"  # a quarter of what the training step's graph needs to hold everything
GROWTH = 0.05  # the most a worker's RSS, descriptors or threads may grow from the first request


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("soak_ckpt")
    make_checkpoint(path, seed=3, num_key_value_heads=2)
    return str(path)


@pytest.fixture(scope="module")
def ray_session():
    with local_ray(2):  # the soak's pool and the fresh one: one worker each
        yield


def concurrently(model, prompts: list[list[int]], new: int = NEW) -> list:
    """Each prompt's `new` tokens, the requests made at once from one thread each; an exception
    that a thread raised is its result."""
    got: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def request(i: int) -> None:
        start.wait()
        try:
            got[i] = model.generate(prompts[i], new, stop_at_eos=False)
        except Exception as e:  # the test names it
            got[i] = e

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def grown(first: list[dict], last: list[dict]) -> list[str]:
    """What grew by more than GROWTH between two `RayPool.usage()` readings."""
    out = []
    for g, (a, b) in enumerate(zip(first, last, strict=True)):
        for k in ("rss_bytes", "open_fds", "threads"):
            if a[k] is not None and b[k] > a[k] * (1 + GROWTH):
                out.append(f"gpu:{g} {k} {a[k]} -> {b[k]}")
    return out


def fresh_tokens(ckpt: str, spill: str) -> list[list[int]]:
    """Each prompt's tokens from a pool that served nothing before."""
    from disco_ray.driver.pool import RayPool

    pool = RayPool()
    try:
        with LlamaModel(ckpt, pool=pool, disk_dir=spill, **MODEL) as model:  # type: ignore[arg-type]
            return [model.generate(p, NEW, stop_at_eos=False) for p in PROMPTS]
    finally:
        pool.close()


@pytest.mark.slow
@pytest.mark.ray
def test_a_pool_serves_many_requests_threads_and_training_without_growing(ckpt, ray_session, tmp_path):
    from disco_ray.driver.pool import RayPool

    spill = tmp_path / "spill"
    spill.mkdir()
    pool = RayPool()
    try:
        with LlamaModel(ckpt, pool=pool, disk_dir=str(spill), **MODEL) as model:  # type: ignore[arg-type]
            got = [model.generate(PROMPTS[0], NEW, stop_at_eos=False)]
            first = pool.usage()
            got += [model.generate(PROMPTS[i % 5], NEW, stop_at_eos=False) for i in range(1, 50)]
            both = concurrently(model, PROMPTS[:4])
            last = pool.usage()
            assert any(p["bytes_offloaded_disk"] for p in model.plans), "no plan used the disk tier"
        data = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
        with LoraTrainer(
            ckpt, capacity=TRAIN_CAPACITY, lora=LoraSpec(rank=4, alpha=8), optim=OptimSpec(lr=1e-2),
            block=16, pool=pool, host_capacity="8KiB", disk_dir=str(spill),
        ) as trainer:  # fmt: skip
            losses = [trainer.step(data[:2])]
            trained = pool.usage()
            losses += trainer.train(data, steps=19, batch=2)
            trained_last = pool.usage()
        left = sorted(os.listdir(spill))
    finally:
        pool.close()
    errors = [e for e in both if isinstance(e, Exception)]
    assert not errors, f"a request from a thread failed: {errors[0]!r}"
    assert not grown(first, last), f"after 54 requests: {grown(first, last)}"
    assert not grown(trained, trained_last), f"after 20 training steps: {grown(trained, trained_last)}"
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses))), losses
    assert left == [], f"the spill directory keeps {left}"
    want = fresh_tokens(ckpt, str(spill))
    assert all(len(w) == NEW for w in want)
    for i, tokens in enumerate(got):
        assert tokens == want[i % 5], f"request {i} (prompt {i % 5}) differs from a fresh pool's"
    for i, tokens in enumerate(both):
        assert tokens == want[i], f"thread {i}'s request differs from a fresh pool's"


def test_requests_from_threads_on_the_local_engine_wait_their_turn(ckpt):
    with LlamaModel(ckpt, engine="local", **MODEL) as model:  # type: ignore[arg-type]
        want = [model.generate(p, 20, stop_at_eos=False) for p in PROMPTS[:4]]
        got = concurrently(model, PROMPTS[:4], 20)
    assert got == want
