"""LoRA fine-tuning through disco-ray with PEFT, transformers and autograd as the oracle.

A tiny random LLaMA (grouped-query attention) and a random adapter (PEFT's `lora_B` made
non-zero, so every path carries gradient) are trained several AdamW (and SGD) steps by PEFT with
torch.optim, and by disco-ray at a roomy and a tight capacity; the losses of every step and the
final adapter weights must agree within float32 tolerance, and the adapter disco-ray writes must
load into `peft.PeftModel`.
"""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from disco_ray.graph.errors import UsageError  # noqa: E402
from disco_ray.models import adapter  # noqa: E402
from disco_ray.models.finetune import LoraTrainer  # noqa: E402
from tests import family_oracle as oracle  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.ray_fixtures import pool  # noqa: E402, F401  (module fixture for the ray test)
from tests.test_models import make_checkpoint  # noqa: E402
from workloads.llm.checkpoint import Checkpoint  # noqa: E402
from workloads.llm.train import LoraSpec, OptimSpec, train_graph  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BLOCK = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    make_checkpoint(path, seed=5, num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=False)
    return str(path)


@pytest.fixture(scope="module")
def init_adapter(base, tmp_path_factory):
    """A PEFT adapter with random A and B (B is zero in PEFT's own init: no gradient for A)."""
    return oracle.random_adapter(base, "LlamaForCausalLM", TARGETS, tmp_path_factory.mktemp("adapter"))


def tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def peft_train(base, init_adapter, data, steps, **kw):
    return oracle.peft_train(base, "LlamaForCausalLM", init_adapter, data, steps, **kw)


def capacity(base, batch, seq, mode):
    ck = Checkpoint(base)
    lora = LoraSpec(rank=4, alpha=8, targets=tuple(TARGETS))
    tg = train_graph(ck, 1, batch, seq, BLOCK, lora, OptimSpec(lr=1e-2)).taskgraph
    return oracle.train_capacity(tg, mode)


@pytest.mark.parametrize("mode", ["roomy", "tight"])
@pytest.mark.parametrize("gpus", [1, 2])
def test_adamw_steps_match_peft(base, init_adapter, mode, gpus):
    data = tokens(2, 9)
    want_losses, want_w = peft_train(base, init_adapter, data, steps=3)
    cap = capacity(base, 2, 9, mode)
    with LoraTrainer(
        base, gpus=gpus, capacity=cap, init_adapter=init_adapter, optim=OptimSpec(lr=1e-2),
        block=BLOCK, engine="local", check=True,
    ) as tr:  # fmt: skip
        losses = tr.train(data, steps=3)
        got = tr.adapter()
        assert [p["sum_into"] for p in tr.plans] == ["eager"], tr.plans  # the default grad_sum
        if mode == "tight":
            assert sum(p["bytes_reloaded"] for p in tr.plans) > 0, tr.plans
    oracle.assert_matches_peft(losses, want_losses, got, want_w)


def test_sgd_with_weight_decay_and_micro_batches_match_peft(base, init_adapter):
    data = tokens(3, 7, seed=1)
    want_losses, want_w = peft_train(
        base, init_adapter, data, steps=3, optim="sgd", lr=0.05, weight_decay=0.1, batch=2
    )
    with LoraTrainer(
        base, capacity=1 << 24, init_adapter=init_adapter, optim=OptimSpec("sgd", lr=0.05, weight_decay=0.1),
        block=BLOCK, engine="local",
    ) as tr:  # fmt: skip
        losses = tr.train(data, steps=3, batch=2)
        got = tr.adapter()
    assert losses == pytest.approx(want_losses, rel=1e-4)
    for k, w in want_w.items():
        torch.testing.assert_close(got[k], w, rtol=2e-4, atol=2e-5, msg=k)


def test_the_written_adapter_loads_into_peft_and_gives_the_same_logits(base, init_adapter, tmp_path):
    data = tokens(2, 9)
    with LoraTrainer(
        base,
        capacity=1 << 24,
        init_adapter=init_adapter,
        optim=OptimSpec(lr=1e-2),
        block=BLOCK,
        engine="local",
    ) as tr:
        tr.train(data, steps=2)
        tr.save_adapter(tmp_path / "out")
        mine = tr.adapter()
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    pm = peft.PeftModel.from_pretrained(model, tmp_path / "out")
    _, want = peft_train(base, init_adapter, data, steps=2)
    for n, p in pm.named_parameters():
        if "lora_" in n:
            k = adapter.PREFIX + n.split("model.layers.", 1)[1].replace(".default", "")
            torch.testing.assert_close(p.detach(), mine[k])
            torch.testing.assert_close(p.detach(), want[k], rtol=2e-4, atol=2e-5)


def test_a_new_adapter_starts_like_peft_with_b_zero(base):
    spec = LoraSpec(rank=2, alpha=4, targets=("q_proj", "down_proj"))
    with LoraTrainer(base, capacity=1 << 24, lora=spec, block=BLOCK, engine="local", seed=3) as tr:
        a0 = tr.adapter()
        loss = tr.step(tokens(1, 6))
    assert all(float(v.abs().sum()) == 0 for k, v in a0.items() if "lora_B" in k)
    assert all(float(v.abs().sum()) > 0 for k, v in a0.items() if "lora_A" in k)
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    x = tokens(1, 6)
    assert loss == pytest.approx(model(input_ids=x, labels=x).loss.item(), rel=1e-5)  # B = 0: the base model


def test_bad_adapters_and_data_are_refused(base, init_adapter, tmp_path):
    import shutil

    shutil.copytree(init_adapter, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    cfg["lora_dropout"] = 0.1
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match=r"lora_dropout 0\.1 is not supported"):
        LoraTrainer(base, capacity=1 << 20, init_adapter=str(tmp_path / "a"), engine="local")
    with pytest.raises(UsageError, match="target module"):
        LoraTrainer(base, capacity=1 << 20, lora=LoraSpec(targets=("lm_head",)), engine="local")
    with LoraTrainer(base, capacity=1 << 24, engine="local", block=BLOCK) as tr:
        with pytest.raises(UsageError, match="token id 500 is outside"):
            tr.step(torch.tensor([[1, 500, 3]]))
        with pytest.raises(UsageError, match=r"integer array \[batch, seq\]"):
            tr.step(torch.zeros(3, 4))


def test_cli_finetune_writes_a_peft_adapter_and_prints_losses(base, init_adapter, tmp_path):
    import numpy as np

    data = tokens(2, 9)
    np.save(tmp_path / "tokens.npy", data.numpy())
    want_losses, want_w = peft_train(base, init_adapter, data, steps=2)
    r = run_cli(
        "finetune", base, "--data", tmp_path / "tokens.npy", "--init-adapter", init_adapter, "--steps", "2",
        "--lr", "0.01", "--capacity", "1MiB", "--out", tmp_path / "out", "--json", "--engine", "local",
        "--block", str(BLOCK), "--grad-sum", "add",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["losses"] == pytest.approx(want_losses, rel=1e-4)
    from safetensors.torch import load_file

    got = load_file(tmp_path / "out" / "adapter_model.safetensors")
    for k, w in want_w.items():
        torch.testing.assert_close(got[k], w, rtol=2e-4, atol=2e-5)
    bad = run_cli("finetune", base, "--data", tmp_path / "tokens.npy", "--steps", "1", "--lr", "0.1",
                  "--capacity", "1MiB", "--out", tmp_path / "o2", "--lora-targets", "q_proj,nope", "--engine", "local")  # fmt: skip
    assert bad.returncode == 2 and "nope" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.ray
def test_the_ray_engine_trains_like_peft(base, init_adapter, pool):  # noqa: F811
    data = tokens(2, 9)
    want_losses, want_w = peft_train(base, init_adapter, data, steps=2)
    with LoraTrainer(
        base, gpus=2, capacity=capacity(base, 2, 9, "tight"), init_adapter=init_adapter, optim=OptimSpec(lr=1e-2),
        block=BLOCK, engine="ray", pool=pool,
    ) as tr:  # fmt: skip
        assert tr.train(data, steps=2) == pytest.approx(want_losses, rel=1e-4)
        got = tr.adapter()
    for k, w in want_w.items():
        torch.testing.assert_close(got[k], w, rtol=2e-4, atol=2e-5, msg=k)


@pytest.mark.parametrize("grad_sum,gpus", [("sum_into", 2), ("add", 1), ("chain", 2)])
def test_each_gradient_sum_matches_peft_at_a_tight_capacity(base, init_adapter, grad_sum, gpus):
    """Sum-into kernels (each partial added as soon as it exists, one at a time), one n-ary add
    and a chain of adds: the same training; the plan checked by the verifier."""
    from planner.verify import verify

    data = tokens(2, 9)
    want_losses, want_w = peft_train(base, init_adapter, data, steps=2)
    cap = capacity(base, 2, 9, "tight")
    with LoraTrainer(
        base, gpus=gpus, capacity=cap, init_adapter=init_adapter, optim=OptimSpec(lr=1e-2),
        block=BLOCK, engine="local", check=True, grad_sum=grad_sum,
    ) as tr:  # fmt: skip
        losses = tr.train(data, steps=2)
        got = tr.adapter()
        ((tgraph, prog),) = tr._programs.values()
        members = sum(v.acc is not None for v in prog.mg.vertices)
        assert (members > 0) == (grad_sum == "sum_into"), members
        assert sum(p["bytes_reloaded"] for p in tr.plans) > 0, tr.plans
        assert verify(tgraph.taskgraph, prog.mg) == []
    for a, b in zip(losses, want_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, want_losses)
    for k, w in want_w.items():
        torch.testing.assert_close(got[k], w, rtol=2e-4, atol=2e-5, msg=k)
