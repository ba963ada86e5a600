"""Qwen2 (q/k/v biases, tied or untied embeddings) and Qwen3 (per-head RMSNorm of queries and
keys) against their transformers classes through the shared oracle checks (tests/family_oracle.py):
prefill logits and greedy tokens at 1 and 2 GPUs, roomy and tight, both engines; a ragged
batch; LoRA on every linear layer against peft. What they do not implement is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from disco_ray.graph.errors import UsageError  # noqa: E402
from tests import family_oracle as oracle  # noqa: E402
from tests.ray_fixtures import pool  # noqa: E402, F401  (module fixture for the ray test)
from workloads.llm.checkpoint import Checkpoint  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen2_tied": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CONFIG = {"qwen2": {}, "qwen2_tied": {"tie_word_embeddings": True}, "qwen3": {"head_dim": 16}}


def _save(name: str, path) -> transformers.PreTrainedModel:
    """A tiny random checkpoint whose biases and q/k norm weights are random too (their
    initialisation, zeros and ones, would let a model that drops them pass)."""
    model = oracle.save(ARCH[name], path, **CONFIG[name])
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight")):
                p.copy_(p + torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, object]]:
    out = {}
    for name in ARCH:
        path = tmp_path_factory.mktemp(name)
        out[name] = (str(path), _save(name, path))
    return out


def test_the_checkpoints_hold_what_each_family_adds(models):
    tensors = {name: Checkpoint(path).tensors for name, (path, _) in models.items()}
    assert tensors["qwen2"]["model.layers.1.self_attn.k_proj.bias"][1] == (32,)
    assert "lm_head.weight" in tensors["qwen2"] and "lm_head.weight" not in tensors["qwen2_tied"]
    assert tensors["qwen3"]["model.layers.0.self_attn.q_norm.weight"][1] == (16,)
    assert not any(n.endswith(".bias") for n in tensors["qwen3"])


@pytest.mark.parametrize(
    "name, gpus, mode",
    [
        ("qwen2", 1, "roomy"),
        ("qwen2", 2, "tight"),
        ("qwen2_tied", 1, "tight"),
        ("qwen3", 1, "tight"),
        ("qwen3", 2, "roomy"),
    ],
)
def test_prefill_logits_and_greedy_tokens_are_transformers(models, name, gpus, mode):
    path, hf = models[name]
    oracle.check_generate(path, hf, gpus, mode)


def test_the_ray_engine_generates_the_same_tokens(models, pool):  # noqa: F811
    path, hf = models["qwen2"]  # each worker reads its rows of the biases from the checkpoint
    oracle.check_generate(path, hf, 2, "tight", new=5, engine="ray", pool=pool)


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3"])
def test_a_ragged_batch_gives_each_prompt_its_own_tokens(models, name):
    path, hf = models[name]
    oracle.check_batch(path, hf, 2, "tight")


@pytest.mark.parametrize(
    "name, gpus, mode",
    [("qwen2", 1, "roomy"), ("qwen2", 2, "tight"), ("qwen3", 1, "tight"), ("qwen3", 2, "roomy")],
)
def test_lora_on_every_linear_layer_trains_as_peft(models, tmp_path, name, gpus, mode):
    path, _ = models[name]
    # seed 8: with the default (7), one of qwen2's gradients is ~1e-7 (a cancellation), which
    # AdamW's first step, g / (|g| + 1e-8), turns into a move decided by float rounding
    adapter = oracle.random_adapter(path, ARCH[name], TARGETS, tmp_path / "adapter", seed=8)
    oracle.check_finetune(path, ARCH[name], TARGETS, adapter, gpus, mode)


def _edited(models, name: str, tmp_path, **edit) -> Path:
    """A copy of checkpoint `name` whose config.json has the fields `edit` (None: removed)."""
    path = tmp_path / "ck"
    shutil.copytree(models[name][0], path)
    cfg = json.loads((path / "config.json").read_text()) | edit
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return path


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4},
            r"layer_types\[1\] 'sliding_attention' is not supported for model_type 'qwen[23]'",
        ),
        (
            {"layer_types": None, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
            r"use_sliding_window true \(max_window_layers 1 < num_hidden_layers 2\) is not supported",
        ),
    ],
    ids=["layer_types", "use_sliding_window"],
)
def test_a_sliding_window_layer_is_refused_naming_the_field(models, tmp_path, name, edit, message):
    with pytest.raises(UsageError, match=message):
        Checkpoint(_edited(models, name, tmp_path, **edit))


def test_sliding_window_settings_that_slide_no_layer_are_accepted(models, tmp_path):
    # transformers: only layers from max_window_layers on slide; here none does
    edit = {"layer_types": None, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}
    assert Checkpoint(_edited(models, "qwen2", tmp_path, **edit)).config.family == "qwen2"


def test_qwen3_attention_bias_is_refused_naming_it(models, tmp_path):
    with pytest.raises(UsageError, match=r"attention_bias True is not supported for model_type 'qwen3'"):
        Checkpoint(_edited(models, "qwen3", tmp_path, attention_bias=True))


def test_a_qwen2_checkpoint_without_its_biases_is_refused(models, tmp_path):
    """Qwen2's biases are part of the model: a checkpoint missing one is not a Qwen2."""
    from safetensors.torch import load_file, save_file

    path = _edited(models, "qwen2", tmp_path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.v_proj.bias"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(UsageError, match=r"no tensor 'model\.layers\.1\.self_attn\.v_proj\.bias'"):
        Checkpoint(path)


def test_attention_dropout_is_read_at_inference_and_refused_by_training(models, tmp_path):
    """transformers drops attention weights only when training: inference is unchanged, and a
    training graph (which has no dropout) refuses the field by name."""
    from workloads.llm.train import LoraSpec, OptimSpec, train_graph

    ck = Checkpoint(_edited(models, "qwen3", tmp_path, attention_dropout=0.1))
    with pytest.raises(UsageError, match=r"attention_dropout 0\.1: training with dropout is not built"):
        train_graph(ck, 1, 1, 8, 4, LoraSpec(rank=4, alpha=8), OptimSpec())
