"""Checkpoints and exact resume of LoRA fine-tuning (`disco_ray.models.train_state`).

One uninterrupted run (AdamW with weight decay, a linear schedule with warmup, batches of 2 of 5
rows, so the data position matters) writes checkpoints at steps 3 and 6; a run resumed from
step 3 must end with the adapter and the optimizer's moments equal to the uninterrupted run's
bit for bit (the gradient sums in a fixed order: grad_sum "add"), through the Python API and the
CLI. A writer that fails midway leaves the previous checkpoint whole; a checkpoint of another
model, LoRA or optimizer is refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("peft")
from safetensors.torch import load_file

from disco_ray.graph.errors import UsageError
from disco_ray.models import train_state
from disco_ray.models.finetune import LoraTrainer
from disco_ray.models.schedule import LrSchedule
from tests.conftest import run_cli
from tests.ray_fixtures import pool  # noqa: F401  (module fixture for the ray test)
from tests.test_models import make_checkpoint
from workloads.llm.train import LoraSpec, OptimSpec

LORA = LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
OPTIM = OptimSpec(lr=1e-2, weight_decay=0.01)
SCHEDULE = LrSchedule.named("linear", 1)
DATA = torch.randint(0, 128, (5, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    make_checkpoint(path, seed=5, num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=False)
    return str(path)


def trainer(base, **kw) -> LoraTrainer:
    args = dict(capacity="64MiB", lora=LORA, optim=OPTIM, lr_schedule=SCHEDULE, block=4, engine="local")
    return LoraTrainer(base, grad_sum="add", seed=3, **(args | kw))


@pytest.fixture(scope="module")
def uninterrupted(base, tmp_path_factory):
    """6 steps, a checkpoint every 3: (the final adapter, the lrs, the output directory)."""
    out = tmp_path_factory.mktemp("run")
    with trainer(base) as tr:
        tr.train(DATA, 6, batch=2, save_every=3, out=str(out))
        return tr.adapter(), list(tr.lrs), out


def test_a_checkpoint_holds_adapter_moments_position_and_rng(base, uninterrupted):
    _, _, out = uninterrupted
    ck = out / "step-3"
    assert sorted(p.name for p in ck.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ]
    doc = json.loads((ck / "trainer_state.json").read_text())
    assert (doc["step"], doc["data_position"], doc["data_rows"], doc["total_steps"]) == (3, 1, 5, 6)
    blobs = load_file(str(ck / "optimizer.safetensors"))
    adapter = load_file(str(ck / "adapter_model.safetensors"))
    for k, w in adapter.items():  # both moments of every matrix, non-zero after three steps
        assert blobs[f"{k}.exp_avg_sq"].shape == w.shape and blobs[f"{k}.exp_avg_sq"].abs().sum() > 0
    assert blobs["rng.torch"].dtype == torch.uint8
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_resume_ends_bit_for_bit_where_the_uninterrupted_run_ends(base, uninterrupted, tmp_path):
    want, lrs, out = uninterrupted
    with trainer(base, lora=None, resume=str(out / "step-3"), total_steps=6) as tr:
        assert (tr.steps_done, tr.data_position) == (3, 1)
        tr.train(DATA, 3, batch=2, save_every=3, out=str(tmp_path))
        got = tr.adapter()
        assert tr.lrs == lrs[3:]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    moments = load_file(str(tmp_path / "step-6" / "optimizer.safetensors"))
    for k, t in load_file(str(out / "step-6" / "optimizer.safetensors")).items():
        assert torch.equal(moments[k], t), k


def test_a_writer_failing_midway_leaves_the_previous_checkpoints_whole(
    base, uninterrupted, tmp_path, monkeypatch
):
    _, _, out = uninterrupted
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    before = {p.name: p.read_bytes() for p in (copy / "step-3").iterdir()}
    real = train_state._write

    def fail_on_state(path, data):
        if path.name == train_state.STATE:
            raise OSError(28, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(train_state, "_write", fail_on_state)
    with trainer(base, lora=None, resume=str(copy / "step-3")) as tr:
        for name in ("step-4", "step-3"):  # a new step, and the same step written again
            with pytest.raises(OSError, match="No space"):
                tr.save_checkpoint(str(copy / name))
    assert not (copy / "step-4").exists()
    assert {p.name: p.read_bytes() for p in (copy / "step-3").iterdir()} == before
    assert sorted(p.name for p in copy.iterdir()) == ["step-3", "step-6"]


def test_a_resume_of_another_model_lora_or_optimizer_is_refused_by_name(base, uninterrupted, tmp_path):
    _, _, out = uninterrupted
    ck = str(out / "step-3")
    with pytest.raises(UsageError, match="LoRA rank differs: 8 in this run, 4"):
        trainer(base, lora=LoraSpec(8, 8, LORA.targets), resume=ck)
    with pytest.raises(UsageError, match="optimizer name differs: 'sgd' in this run, 'adamw'"):
        trainer(base, lora=None, optim=OptimSpec("sgd", 1e-2), resume=ck)
    other = tmp_path / "other"  # the same shapes, another model
    make_checkpoint(
        other,
        seed=5,
        num_key_value_heads=2,
        num_hidden_layers=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-3,
    )
    with pytest.raises(UsageError, match=r"model rms_norm_eps differs: 0\.001 in this run"):
        trainer(str(other), lora=None, resume=ck)
    with (
        trainer(base, lora=None, resume=ck) as tr,
        pytest.raises(UsageError, match="the resumed checkpoint's had 5"),
    ):
        tr.train(DATA[:4], 1, batch=2)


def test_the_cli_resumes_to_the_uninterrupted_adapter(base, tmp_path):
    """With --save-every or --resume the gradient sums default to a fixed order ("add")."""
    data = tmp_path / "data.npy"
    import numpy as np

    np.save(data, DATA.numpy())
    common = [
        "finetune", base, "--data", data, "--lr", "1e-2", "--capacity", "64MiB", "--engine", "local",
        "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,down_proj", "--batch", "2",
        "--lr-schedule", "cosine", "--warmup-steps", "1", "--block", "4", "--steps", "6",
        "--max-grad-norm", "0.5", "--save-every", "3",
    ]  # fmt: skip
    a, b = tmp_path / "a", tmp_path / "b"
    r = run_cli(*common, "--out", a)
    assert r.returncode == 0, r.stderr
    r = run_cli(*common, "--out", b, "--resume", a / "step-3")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 3  # steps 4 to 6
    want, got = (
        load_file(str(a / "adapter_model.safetensors")),
        load_file(str(b / "adapter_model.safetensors")),
    )
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    r = run_cli(*common, "--out", b, "--resume", a / "step-3", "--lora-rank", "8")
    assert r.returncode == 2 and "--lora-rank 8 differs from the checkpoint's 4" in r.stderr
    r = run_cli(*common, "--out", b, "--resume", tmp_path / "nothing")
    assert r.returncode == 2 and "nothing/adapter_config.json: missing" in r.stderr


@pytest.mark.ray
def test_a_ray_run_checkpoints_what_a_local_run_resumes(base, uninterrupted, tmp_path, pool):  # noqa: F811
    want, _, _ = uninterrupted
    with trainer(base, engine="ray", pool=pool, total_steps=6) as tr:
        tr.train(DATA, 3, batch=2, save_every=3, out=str(tmp_path))
    with trainer(base, lora=None, resume=str(tmp_path / "step-3"), total_steps=6) as tr:
        tr.train(DATA, 3, batch=2)
        got = tr.adapter()
    for k in want:
        assert torch.equal(got[k], want[k]), k
