"""The trainer's defaults for speed: one tile per sequence of up to 512 tokens, one compute stream
on the cpu backend, a ray worker's intra-op threads; trained with them, it still equals PEFT."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("peft")

from actors.worker import cpu_threads
from disco_ray.graph.errors import UsageError
from disco_ray.models.finetune import LoraTrainer
from disco_ray.models.train_defaults import default_streams, train_block
from tests import family_oracle as oracle
from tests.test_models import make_checkpoint
from workloads.llm.train import OptimSpec

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    make_checkpoint(path, seed=5, num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=False)
    return str(path)


def test_the_default_tile_is_the_fewest_equal_tiles_of_at_most_512_tokens():
    assert [train_block(n) for n in (2, 9, 512, 513, 600, 1024, 1025, 4096)] == [
        2, 9, 512, 257, 300, 512, 342, 512,
    ]  # fmt: skip
    assert default_streams("cpu") == 1 and default_streams("cuda") == 5


def test_a_ray_worker_shares_the_cores_among_the_streams_of_the_graph():
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(1, 1) == cores
    assert cpu_threads(5, 2) == max(1, cores // 10)
    assert cpu_threads(cores + 1, 1) == 1


def test_default_tiles_and_streams_train_as_peft(base, tmp_path):
    init = oracle.random_adapter(base, "LlamaForCausalLM", TARGETS, tmp_path / "adapter")
    data = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    want_losses, want_w = oracle.peft_train(base, "LlamaForCausalLM", init, data, 2)
    with LoraTrainer(
        base, capacity=1 << 24, init_adapter=init, optim=OptimSpec(lr=1e-2), engine="local"
    ) as tr:
        losses = tr.train(data, steps=2)
        got = tr.adapter()
        assert tr.block is None and tr._prog_kw["streams"] == 1
    oracle.assert_matches_peft(losses, want_losses, got, want_w)


@pytest.mark.parametrize("block", [0, -4, 2.5, True])
def test_a_bad_block_is_refused_by_name(base, block):
    with pytest.raises(UsageError, match="block must be a whole number of tokens >= 1"):
        LoraTrainer(base, capacity=1 << 24, engine="local", block=block)
