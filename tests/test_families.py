"""The family registry: LLaMA through the shared oracle checks, and what no family understands
refused with one error naming it (a model_type, a config field, a tensor the model would not use)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from disco_ray.graph.errors import UsageError  # noqa: E402
from tests import family_oracle as oracle  # noqa: E402
from workloads.llm.checkpoint import Checkpoint  # noqa: E402
from workloads.llm.families import FAMILIES  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return str(path), oracle.save("LlamaForCausalLM", path)


def test_llama_through_the_shared_checks(llama):
    path, hf = llama
    oracle.check_generate(path, hf, 2, "tight")


def test_the_registry_names_each_family_by_its_model_type():
    for mt, fam in FAMILIES.items():
        assert fam.model_type == mt and fam.architecture.endswith("ForCausalLM")


def test_a_model_type_with_no_family_is_refused_naming_it(tmp_path):
    path = tmp_path / "ck"
    oracle.save("LlamaForCausalLM", path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"model_type": "falcon"}))
    with pytest.raises(UsageError, match=r"model_type 'falcon'.*not supported"):
        Checkpoint(path)


def test_a_qwen2_checkpoint_relabelled_llama_is_refused_by_its_unused_bias(tmp_path):
    """The issue's case: q/k/v biases that LLaMA's layer would ignore mean a different model."""
    path = tmp_path / "ck"
    oracle.save("Qwen2ForCausalLM", path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"model_type": "llama"}))
    with pytest.raises(
        UsageError, match=r"tensor 'model\.layers\.0\.self_attn\.[qkv]_proj\.bias' is not used"
    ):
        Checkpoint(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"attention_bias": True}, "attention_bias True is not supported"),
        ({"mlp_bias": True}, "mlp_bias True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling type 'yarn'"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor 0.5",
        ),
    ],
)
def test_a_config_field_that_changes_the_computation_is_refused_naming_it(tmp_path, edit, message):
    path = Path(tmp_path / "ck")
    oracle.save("LlamaForCausalLM", path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | edit))
    with pytest.raises(UsageError, match=message):
        Checkpoint(path)
