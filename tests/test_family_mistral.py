"""Mistral (`MistralForCausalLM`) against transformers and peft, at a sliding window (5) smaller
than the prompt (10 tokens, cache blocks of 4), so the window really cuts: prefill, decode, a
ragged batch and LoRA fine-tuning on every linear layer; a decode step reads only the cache
blocks that reach into its window, and the blocks behind it are dropped from the workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from disco_ray.graph.errors import UsageError  # noqa: E402
from disco_ray.models import LlamaModel  # noqa: E402
from tests import family_oracle as oracle  # noqa: E402
from tests.ray_fixtures import pool  # noqa: E402, F401  (module fixture for the ray test)
from workloads.llm.checkpoint import Checkpoint  # noqa: E402
from workloads.llm.model import decode_graph, prefill_graph  # noqa: E402

WINDOW = 5
ARCH = "MistralForCausalLM"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    return str(path), oracle.save(ARCH, path, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def adapter(mistral, tmp_path_factory):
    return oracle.random_adapter(mistral[0], ARCH, TARGETS, tmp_path_factory.mktemp("adapter"))


def test_the_window_is_read_for_every_layer(mistral):
    cfg = Checkpoint(mistral[0]).config
    assert cfg.family == "mistral" and cfg.windows == (WINDOW,) * cfg.layers
    assert [cfg.spec.first_key(li, 9) for li in range(cfg.layers)] == [5, 5]


@pytest.mark.parametrize("gpus, mode", [(1, "roomy"), (1, "tight"), (2, "roomy"), (2, "tight")])
def test_generate_equals_transformers(mistral, gpus, mode):
    oracle.check_generate(*mistral, gpus, mode)


@pytest.mark.ray
def test_the_ray_engine_generates_the_same_tokens(mistral, pool):  # noqa: F811
    oracle.check_generate(*mistral, 2, "tight", engine="ray", pool=pool)


def test_a_ragged_batch_equals_each_prompts_own_decoding(mistral):
    oracle.check_batch(*mistral, 2, "tight")


def test_prefill_tiles_read_only_the_key_tiles_in_their_window(mistral):
    """Tiles of one block: the third (rows 8..11) reads key tiles 1 and 2 (its first row's window
    starts at 4), and the logits are still transformers'."""
    path, hf = mistral
    tg = prefill_graph(Checkpoint(path), 1, 3, oracle.BLOCK, tile=oracle.BLOCK).taskgraph
    assert len(tg["l0.t2.attn_g0"].inputs) == 1 + 2 * 2 and len(tg["l0.t1.attn_g0"].inputs) == 1 + 2 * 2
    with (
        LlamaModel(
            path, gpus=2, capacity=1 << 26, block=oracle.BLOCK, tile=oracle.BLOCK, engine="local"
        ) as m,
        torch.no_grad(),
    ):
        assert oracle.rel_err(m.prefill(oracle.PROMPT), hf(torch.tensor([oracle.PROMPT])).logits[0]) <= 1e-4
        for row, p in zip(m.prefill_batch(oracle.PROMPTS), oracle.PROMPTS):
            assert oracle.rel_err(row, hf(torch.tensor([p])).logits[0, -1]) <= 1e-4


def _state_bytes(path: str, gpus: int, blocks: int) -> int:
    tg = decode_graph(Checkpoint(path), gpus, blocks, oracle.BLOCK).taskgraph
    return sum(v.nbytes for v in tg.vertices.values() if v.state)


def test_a_decode_step_reads_only_the_cache_blocks_in_its_window(mistral, tmp_path):
    """The cache a step's graph reads stops growing once past the window (a window of 5 reaches
    into 2 blocks of 4), where the same model with full attention reads every block; a run's
    bytes loaded per step alike, its tokens transformers'."""
    path, hf = mistral
    full = tmp_path / "full"
    oracle.save(ARCH, full, sliding_window=None)
    block = 2 * 2 * (2 * 16) * 4 * oracle.BLOCK  # K and V, 2 layers, 2 key/value heads of 16, float32
    for gpus in (1, 2):
        assert [_state_bytes(path, gpus, n) for n in range(1, 7)] == [block * min(n, 2) for n in range(1, 7)]
        assert [_state_bytes(str(full), gpus, n) for n in range(1, 7)] == [block * n for n in range(1, 7)]
    cap = oracle.capacity(path, 1, "tight", len(oracle.PROMPT), 16)
    with LlamaModel(path, gpus=1, capacity=cap, block=oracle.BLOCK, engine="local") as m:
        got = m.run_generate_batch([oracle.PROMPT], 16, stop_at_eos=False, steps_per_call=1)
        loaded = got.statistics()["bytes_loaded_per_step"]
        assert len(loaded) == 15 and len(set(loaded)) == 1, loaded
        assert got.sequences[0].new_ids == oracle.greedy(hf, oracle.PROMPT, 16)


def test_the_blocks_behind_the_window_are_dropped_from_the_workers(mistral):
    path, hf = mistral
    cap = oracle.capacity(path, 2, "roomy", len(oracle.PROMPT), 16)
    with LlamaModel(path, gpus=2, capacity=cap, block=oracle.BLOCK, engine="local") as m:
        assert m.generate(oracle.PROMPT, 16, stop_at_eos=False) == oracle.greedy(hf, oracle.PROMPT, 16)
        # position 24 was the last fed: its window reads blocks 5 and 6, the only ones kept
        # (K and V of 2 layers, on each GPU)
        assert m.pool.state_count() == [2 * 2 * 2] * 2
        assert m.generate(oracle.PROMPT, 3, stop_at_eos=False) == oracle.greedy(hf, oracle.PROMPT, 3)


@pytest.mark.parametrize("gpus, mode", [(1, "roomy"), (1, "tight"), (2, "roomy"), (2, "tight")])
def test_lora_on_every_linear_layer_equals_peft(mistral, adapter, gpus, mode):
    oracle.check_finetune(mistral[0], ARCH, TARGETS, adapter, gpus, mode)


def test_lora_gradients_over_long_sequences_equal_peft(mistral, adapter):
    """SGD (its update is the gradient) on 17 tokens: tiles 2 and 3 hold labelled rows and skip
    key tile 0 (behind their window), forward, recomputation and backward."""
    from disco_ray.models.finetune import LoraTrainer
    from workloads.llm.train import OptimSpec

    data = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    want_losses, want_w = oracle.peft_train(mistral[0], ARCH, adapter, data, steps=2, lr=0.5, optim="sgd")
    with LoraTrainer(
        mistral[0], gpus=2, capacity=1 << 26, init_adapter=adapter, optim=OptimSpec(name="sgd", lr=0.5),
        block=oracle.BLOCK, engine="local",
    ) as tr:  # fmt: skip
        losses = tr.train(data, steps=2)
        got = tr.adapter()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    for k, w in want_w.items():
        torch.testing.assert_close(got[k], w, rtol=2e-4, atol=2e-5, msg=k)


def _edited(path: str, tmp_path, **edit) -> str:
    out = tmp_path / "edited"
    out.mkdir()
    for f in Path(path).iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | edit))
    return str(out)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"sliding_window": 0}, "'sliding_window' must be positive, got 0"),
        ({"sliding_window": 4.5}, "'sliding_window' must be int, got 4.5"),
        ({"attention_bias": True}, "attention_bias True is not supported for model_type 'mistral'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_a_config_field_that_changes_the_computation_is_refused_naming_it(mistral, tmp_path, edit, message):
    with pytest.raises(UsageError, match=message):
        Checkpoint(_edited(mistral[0], tmp_path, **edit))


def test_no_window_is_full_attention(mistral, tmp_path):
    cfg = Checkpoint(_edited(mistral[0], tmp_path, sliding_window=None)).config
    assert cfg.windows == () and cfg.spec.window(0) is None
