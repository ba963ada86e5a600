"""Gemma 2 (`Gemma2ForCausalLM`) through the shared oracle checks, and its config read or refused.

The tiny checkpoint sets what Gemma 2 adds so that each matters: norms with random weights (the
class initializes them to zero: (1 + w) would be 1), post norms larger than the rest (so the
blocks, not the scaled embedding, choose the tokens), attention and final soft-caps small enough to
bend the scores and logits, head_dim 16 apart from hidden_size / heads and query_pre_attn_scalar 16.
Its first layer slides with a window of 5 keys (narrower than the prompt: the window cuts in
prefill, decode, batches and training), its second attends to every key.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from disco_ray.graph.errors import UsageError  # noqa: E402
from tests import family_oracle as oracle  # noqa: E402
from tests.ray_fixtures import pool  # noqa: E402, F401  (module fixture for the ray test)
from workloads.llm.checkpoint import Checkpoint  # noqa: E402
from workloads.llm.families.gemma2 import layer_windows  # noqa: E402
from workloads.llm.layer import Activation  # noqa: E402

ARCH = "Gemma2ForCausalLM"
GEMMA = dict(
    head_dim=16,
    query_pre_attn_scalar=16,
    attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0,
    max_position_embeddings=128,
    sliding_window=5,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save(path, **overrides):
    """A tiny random Gemma 2 whose norm weights are random too (post norms around 2), saved at `path`."""
    hf = oracle.save(ARCH, path, **(GEMMA | overrides))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (2.0 if ".post_" in name else 0.0))
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2")
    return str(path), save(path)


@pytest.fixture(scope="module")
def adapter(gemma, tmp_path_factory):
    return oracle.random_adapter(gemma[0], ARCH, TARGETS, tmp_path_factory.mktemp("gemma2_lora"))


@pytest.mark.parametrize("gpus, mode", [(1, "roomy"), (2, "tight")])
def test_generate_matches_transformers(gemma, gpus, mode):
    path, hf = gemma
    oracle.check_generate(path, hf, gpus, mode)


@pytest.mark.ray
def test_the_ray_engine_generates_the_same_tokens(gemma, pool):  # noqa: F811
    path, hf = gemma
    oracle.check_generate(path, hf, 2, "roomy", new=4, engine="ray", pool=pool)


def test_a_ragged_batch_matches_each_prompt_alone(gemma):
    path, hf = gemma
    oracle.check_batch(path, hf, 2, "tight")


@pytest.mark.parametrize("gpus, mode", [(1, "tight"), (2, "roomy")])
def test_lora_on_every_linear_layer_matches_peft(gemma, adapter, gpus, mode):
    oracle.check_finetune(gemma[0], ARCH, TARGETS, adapter, gpus, mode)


def test_the_config_is_read_as_gemma2_computes(gemma):
    c = Checkpoint(gemma[0]).config
    assert (c.family, c.act, c.tie, c.head_dim) == ("gemma2", Activation.GELU_TANH, True, 16)
    assert (c.norm_offset, c.embed_scale, c.attn_softcap, c.final_softcap) == (1.0, True, 2.0, 3.0)
    assert c.scale == 16**-0.5 and c.spec.softcap == 2.0
    w = c.spec.weights
    assert (w.mlp_norm, w.attn_post_norm, w.mlp_post_norm) == (
        "pre_feedforward_layernorm.weight",
        "post_attention_layernorm.weight",
        "post_feedforward_layernorm.weight",
    )


def test_null_soft_caps_mean_none():
    cfg = _cfg(attn_logit_softcapping=None, final_logit_softcapping=None)
    c = Checkpoint.from_config(cfg).config
    assert (c.attn_softcap, c.final_softcap) == (None, None)


def test_windows_per_layer_from_layer_types_or_the_alternating_rule():
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    assert layer_windows(_cfg(num_hidden_layers=3, layer_types=types, sliding_window=8), "c") == (
        None,
        8,
        8,
    )
    older = {k: v for k, v in _cfg(num_hidden_layers=3, sliding_window=8).items() if k != "layer_types"}
    assert layer_windows(older, "c") == (8, None, 8)  # transformers' rule: even layers slide


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"attention_bias": True}, "attention_bias True is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention True is not supported"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types must list 2"),
        ({"sliding_window": None}, "sliding_attention layers but no sliding_window"),
        ({"attn_logit_softcapping": -1.0}, "'attn_logit_softcapping' must be positive"),
        ({"head_dim": None}, "missing 'head_dim'"),
    ],
)
def test_what_gemma2_does_not_compute_is_refused_naming_it(edit, message):
    cfg = _cfg(**edit)
    if edit.get("head_dim", 0) is None:
        del cfg["head_dim"]
    with pytest.raises(UsageError, match=message):
        Checkpoint.from_config(cfg)


def test_a_gemma2_tensor_set_relabelled_llama_is_refused(gemma, tmp_path):
    """LLaMA's layer would ignore the post norms: a different model, refused by their names."""
    path = tmp_path / "ck"
    save(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"model_type": "llama", "hidden_act": "silu"}))
    with pytest.raises(UsageError, match=r"tensor 'model\.layers\.0\.post_(attention|feedforward)_layernorm"):
        Checkpoint(path)


def test_llama_graphs_have_no_gemma_feature_on(tmp_path):
    """LLaMA's graphs compute what they did: no norm offset, soft-cap or embedding scale set."""
    from workloads.llm.model import decode_graph, prefill_graph

    path = tmp_path / "llama"
    oracle.save("LlamaForCausalLM", path)
    ck = Checkpoint(path)
    for g in (prefill_graph(ck, 2, 3, 4).taskgraph, decode_graph(ck, 2, 2, 4).taskgraph):
        vs = list(g.vertices.values())
        assert not {v.op for v in vs} & {"softcap", "gelu_tanh"}
        assert all((v.attrs or {}).get("softcap") is None for v in vs)
        assert all(v.attrs.get("offset", 0.0) == 0.0 for v in vs if v.op == "rmsnorm")
        assert all(v.attrs.get("scale", 1.0) == 1.0 for v in vs if v.op == "embedding")


def _cfg(**edit) -> dict:
    cfg = transformers.Gemma2Config(**(oracle.BASE | GEMMA)).to_dict()
    cfg |= {"model_type": "gemma2", "architectures": [ARCH]}
    return cfg | edit
