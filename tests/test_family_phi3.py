"""Phi-3 (`Phi3ForCausalLM`) against transformers and peft: fused qkv_proj and gate_up_proj read
as each GPU's row blocks, generation, batches, LoRA on the fused modules, and what is refused (the
unfused names, longrope, dropout in training) and the sliding window as transformers cuts keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from disco_ray.graph.errors import UsageError  # noqa: E402
from disco_ray.models import LlamaModel, adapter  # noqa: E402
from disco_ray.models.finetune import LoraTrainer  # noqa: E402
from tests import family_oracle as oracle  # noqa: E402
from tests.ray_fixtures import pool  # noqa: E402, F401  (module fixture for the ray test)
from workloads.llm.checkpoint import Checkpoint  # noqa: E402
from workloads.llm.model import prefill_graph  # noqa: E402
from workloads.llm.train import LoraSpec, OptimSpec, train_graph  # noqa: E402

ARCH = "Phi3ForCausalLM"
MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # peft's names of its linear layers
WINDOW = 64  # below max_position_embeddings (128), as Phi-3 mini's 2047 is below its 4096


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3")
    return str(path), oracle.save(ARCH, path, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def lora_init(phi3, tmp_path_factory):
    return oracle.random_adapter(phi3[0], ARCH, MODULES, tmp_path_factory.mktemp("adapter"))


def edited(tmp_path, **edit) -> Path:
    """A tiny Phi-3 checkpoint whose config.json has the fields `edit` (None: removed)."""
    path = tmp_path / "ck"
    oracle.save(ARCH, path)
    cfg = json.loads((path / "config.json").read_text()) | edit
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return path


# ---- the fused tensors ---------------------------------------------------------------------------
def test_each_gpu_reads_its_rows_of_the_fused_tensors(phi3):
    ck = Checkpoint(phi3[0])
    q, kv, ffn = 4 * 16, 2 * 16, 96
    assert ck.tensors["model.layers.0.self_attn.qkv_proj.weight"][1] == (q + 2 * kv, 64)
    assert ck.tensors["model.layers.1.mlp.gate_up_proj.weight"][1] == (2 * ffn, 64)
    g = prefill_graph(ck, 2, 1, oracle.BLOCK).taskgraph
    rows = {
        (role, j): g[f"l0.{role}_g{j}"].source.slices[0]  # type: ignore[union-attr]
        for role in ("q", "k", "v", "gate", "up")
        for j in range(2)
    }
    # GPU j: its 2 query heads, its 1 key/value head, its half of the gate units and of the up units
    assert rows == {
        ("q", 0): (0, 32), ("q", 1): (32, 64),
        ("k", 0): (64, 80), ("k", 1): (80, 96),
        ("v", 0): (96, 112), ("v", 1): (112, 128),
        ("gate", 0): (0, 48), ("gate", 1): (48, 96),
        ("up", 0): (96, 144), ("up", 1): (144, 192),
    }  # fmt: skip
    assert {g[f"l0.{r}_g1"].source.tensor for r in "qkv"} == {  # type: ignore[union-attr]
        "model.layers.0.self_attn.qkv_proj.weight"
    }


def test_a_checkpoint_with_unfused_projections_is_refused(tmp_path):
    """A LLaMA's q_proj under model_type phi3: not Phi-3's tensors, refused by name."""
    path = tmp_path / "ck"
    oracle.save("LlamaForCausalLM", path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"model_type": "phi3"}))
    with pytest.raises(
        UsageError,
        match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' is not used by model_type 'phi3'",
    ):
        Checkpoint(path)


# ---- generation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["roomy", "tight"])
@pytest.mark.parametrize("gpus", [1, 2])
def test_generate_matches_transformers(phi3, gpus, mode):
    oracle.check_generate(*phi3, gpus, mode)


def test_the_ray_engine_generates_the_same_tokens(phi3, pool):  # noqa: F811
    oracle.check_generate(*phi3, 2, "tight", new=5, engine="ray", pool=pool)


def test_a_ragged_batch_matches_transformers(phi3):
    oracle.check_batch(*phi3, 2, "tight")


# ---- the sliding window --------------------------------------------------------------------------
def test_beyond_the_window_keys_are_cut_as_transformers_cuts_them(tmp_path):
    """transformers' Phi-3 masks keys more than sliding_window behind a query: a sequence of
    `window` tokens is computed as with full attention, longer ones are cut, here as there
    (prefill, greedy generation past the window, and a training graph's sequence)."""
    w = 12
    hf = oracle.save(ARCH, tmp_path / "ck", sliding_window=w)
    full = transformers.Phi3ForCausalLM.from_pretrained(tmp_path / "ck", sliding_window=None).eval()
    ids = torch.tensor([list(range(3, 3 + w + 4))])
    with torch.no_grad():
        cut, whole = hf(ids).logits[0], full(ids).logits[0]
    torch.testing.assert_close(cut[:w], whole[:w])
    assert oracle.rel_err(cut[w:], whole[w:]) > 1e-3
    prompt = ids[0, : w - 2].tolist()
    with LlamaModel(str(tmp_path / "ck"), capacity=1 << 24, block=oracle.BLOCK, engine="local") as m:
        assert oracle.rel_err(m.prefill(ids[0].tolist()), cut) <= 1e-4
        assert m.generate(prompt, 6, stop_at_eos=False) == oracle.greedy(hf, prompt, 6)
    spec = LoraSpec(rank=2, alpha=4, targets=("qkv_proj",))
    tg = train_graph(Checkpoint(tmp_path / "ck"), 1, 1, w + 4, oracle.BLOCK, spec, OptimSpec()).taskgraph
    assert {v.attrs["window"] for v in tg if "window" in v.attrs} == {w}  # forward and backward


def test_every_layer_slides_by_the_window(tmp_path):
    assert Checkpoint(edited(tmp_path, sliding_window=20)).config.windows == (20, 20)
    assert Checkpoint(edited(tmp_path, sliding_window=None)).config.windows == ()


# ---- what is refused -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "edit, message",
    [
        ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}},
         "rope_scaling type 'longrope' is not supported"),
        ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
          "rope_parameters": None}, "rope_scaling type 'su' is not supported"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
         "rope_scaling type 'linear' is not supported for model_type 'phi3'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"resid_pdrop": 1.5}, "'resid_pdrop' must be in"),
    ],
)  # fmt: skip
def test_a_config_field_that_changes_the_computation_is_refused_naming_it(tmp_path, edit, message):
    with pytest.raises(UsageError, match=message):
        Checkpoint(edited(tmp_path, **edit))


def test_dropout_runs_inference_and_is_refused_by_training(tmp_path):
    """Dropout changes nothing at inference (transformers' eval mode); training has none."""
    ck = Checkpoint(edited(tmp_path, resid_pdrop=0.1, attention_dropout=0.0))
    assert ck.config.dropout == (("resid_pdrop", 0.1),)
    spec = LoraSpec(rank=2, alpha=4, targets=("qkv_proj",))
    with pytest.raises(
        UsageError, match=r"config\.json: resid_pdrop 0\.1: training with dropout is not built"
    ):
        train_graph(ck, 1, 1, 8, oracle.BLOCK, spec, OptimSpec())


def test_a_lora_target_that_phi3_does_not_have_is_refused(phi3):
    spec = LoraSpec(rank=2, alpha=4, targets=("q_proj", "down_proj"))
    with pytest.raises(UsageError, match=r"\['q_proj'\] are not modules of model_type 'phi3'"):
        train_graph(Checkpoint(phi3[0]), 1, 1, 8, oracle.BLOCK, spec, OptimSpec())
    with pytest.raises(UsageError, match=r"\['q_proj'\] are not modules of model_type 'phi3'"):
        LoraTrainer(phi3[0], capacity=1 << 24, lora=spec, block=oracle.BLOCK, engine="local")


# ---- LoRA on the fused modules -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["roomy", "tight"])
@pytest.mark.parametrize("gpus", [1, 2])
def test_finetune_matches_peft(phi3, lora_init, gpus, mode):
    oracle.check_finetune(phi3[0], ARCH, MODULES, lora_init, gpus, mode)


def test_the_written_adapter_is_peft_s_and_gives_peft_s_logits(phi3, lora_init, tmp_path):
    data = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with LoraTrainer(phi3[0], gpus=2, capacity=1 << 24, init_adapter=lora_init, optim=OptimSpec(lr=1e-2),
                     block=oracle.BLOCK, engine="local") as tr:  # fmt: skip
        tr.train(data, steps=2)
        tr.save_adapter(tmp_path / "out")
    _, want = oracle.peft_train(phi3[0], ARCH, lora_init, data, steps=2)
    base = transformers.Phi3ForCausalLM.from_pretrained(phi3[0])
    pm = peft.PeftModel.from_pretrained(base, tmp_path / "out").eval()
    loaded = {
        adapter.PREFIX + n.split("model.layers.", 1)[1].replace(".default", ""): p.detach()
        for n, p in pm.named_parameters()
        if "lora_" in n
    }
    assert {k: v.shape for k, v in loaded.items()} == {k: v.shape for k, v in want.items()}
    assert loaded["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"].shape == (128, 4)
    theirs = oracle.peft_model(phi3[0], ARCH, want)
    with torch.no_grad():
        got, expect = pm(data).logits, theirs(data).logits
    assert oracle.rel_err(got, expect) <= 1e-4


def test_a_new_adapter_takes_phi3_s_default_modules_with_b_zero(phi3):
    with LoraTrainer(phi3[0], capacity=1 << 24, block=oracle.BLOCK, engine="local") as tr:
        a0 = tr.adapter()
        assert tr.lora.targets == ("qkv_proj", "gate_up_proj", "down_proj")
    assert a0["base_model.model.model.layers.1.mlp.gate_up_proj.lora_B.weight"].shape == (192, 16)
    assert all(float(v.abs().sum()) == 0 for k, v in a0.items() if "lora_B" in k)


def test_finetune_s_command_adapts_phi3_s_modules_by_default(phi3, tmp_path):
    import numpy as np

    from tests.conftest import run_cli

    np.save(tmp_path / "tokens.npy", torch.randint(0, 128, (1, 6)).numpy())
    common = ("--data", tmp_path / "tokens.npy", "--steps", "1", "--lr", "0.01", "--capacity", "4MiB",
              "--engine", "local", "--block", str(oracle.BLOCK), "--lora-rank", "2")  # fmt: skip
    r = run_cli("finetune", phi3[0], *common, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert doc["target_modules"] == ["qkv_proj", "gate_up_proj", "down_proj"]
    bad = run_cli("finetune", phi3[0], *common, "--out", tmp_path / "o2", "--lora-targets", "q_proj")
    assert bad.returncode == 2 and "not modules of model_type 'phi3'" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "o2").exists()
