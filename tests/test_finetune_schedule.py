"""Learning-rate schedules, gradient accumulation and gradient clipping of LoRA fine-tuning.

The schedules' rates equal `transformers.get_scheduler`'s step by step (warmup included); K
micro-batches of B rows in one step's graph equal one batch of K*B rows; clipping on 2 GPUs with a
cosine schedule equals peft + `torch.nn.utils.clip_grad_norm_` + torch AdamW +
`get_scheduler`, the pre-clip norm of every step included.
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from disco_ray.graph.errors import UsageError  # noqa: E402
from disco_ray.models import adapter  # noqa: E402
from disco_ray.models.finetune import LoraTrainer  # noqa: E402
from disco_ray.models.schedule import LrSchedule  # noqa: E402
from tests import family_oracle as oracle  # noqa: E402
from tests.test_models import make_checkpoint  # noqa: E402
from workloads.llm.train import OptimSpec  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DATA = torch.randint(0, 128, (4, 9), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    make_checkpoint(path, seed=5, num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=False)
    return str(path)


@pytest.fixture(scope="module")
def init_adapter(base, tmp_path_factory):
    return oracle.random_adapter(base, "LlamaForCausalLM", TARGETS, tmp_path_factory.mktemp("adapter"))


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
def test_the_rates_equal_get_schedulers(name, warmup):
    total, lr = 10, 3e-4
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = LrSchedule.named(name, warmup)
    hf = transformers.get_scheduler(sched.hf_name, opt, num_warmup_steps=warmup, num_training_steps=total)
    for done in range(total):
        assert lr * sched.factor(done, total) == opt.param_groups[0]["lr"], (name, warmup, done)
        opt.step()
        hf.step()


def test_a_bad_schedule_is_refused_by_name():
    with pytest.raises(UsageError, match="'step' is not one of constant, linear, cosine"):
        LrSchedule.named("step")
    with pytest.raises(UsageError, match="warmup steps must be an integer >= 0, got -1"):
        LrSchedule.named("linear", -1)
    with pytest.raises(UsageError, match="linear learning-rate schedule needs the run's total steps"):
        LrSchedule.named("linear").factor(0, None)


def trained(base, init_adapter, steps, gpus=1, **kw):
    """(losses, adapter, trainer statistics) of `steps` steps on DATA."""
    batch = kw.pop("batch", None)
    optim = kw.pop("optim", OptimSpec(lr=1e-2))
    with LoraTrainer(
        base,
        gpus=gpus,
        capacity="64MiB",
        init_adapter=init_adapter,
        optim=optim,
        block=4,
        engine="local",
        **kw,
    ) as tr:
        losses = tr.train(DATA, steps, batch=batch)
        return losses, tr.adapter(), tr.statistics()


def test_grad_accum_of_k_micro_batches_equals_one_batch_of_k(base, init_adapter):
    whole = trained(base, init_adapter, 2, batch=4)
    accum = trained(base, init_adapter, 2, batch=2, grad_accum=2)
    assert accum[2]["grad_accum"] == 2 and accum[2]["plans"][0]["graph"] == "train/4x9"
    assert accum[0] == pytest.approx(whole[0], rel=1e-5)
    for k, w in whole[1].items():
        torch.testing.assert_close(accum[1][k], w, rtol=1e-5, atol=1e-6, msg=k)
    # the first step's loss: transformers' with accumulation, the mean of the micro-batches' means
    pm = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), init_adapter)
    with torch.no_grad():
        means = [pm(input_ids=x, labels=x).loss.item() for x in (DATA[:2], DATA[2:])]
    assert accum[0][0] == pytest.approx(sum(means) / 2, rel=1e-5)


def peft_clipped(base, init_adapter, steps, lr, max_norm, sched: LrSchedule):
    """peft + clip_grad_norm_ + torch AdamW + get_scheduler: (losses, pre-clip norms, lrs, adapter)."""
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    pm = peft.PeftModel.from_pretrained(model, init_adapter, is_trainable=True)
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    hf = transformers.get_scheduler(
        sched.hf_name, opt, num_warmup_steps=sched.warmup, num_training_steps=steps
    )
    losses, norms, lrs = [], [], []
    for _ in range(steps):
        loss = pm(input_ids=DATA, labels=DATA).loss
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm).item())
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        hf.step()
        losses.append(loss.item())
    weights = {
        adapter.PREFIX + n.split("model.layers.", 1)[1].replace(".default", ""): p.detach().clone()
        for n, p in pm.named_parameters()
        if "lora_" in n
    }
    return losses, norms, lrs, weights


def test_clipping_on_two_gpus_equals_clip_grad_norm_with_a_schedule(base, init_adapter):
    sched, steps, max_norm = LrSchedule.named("cosine", 1), 4, 0.05
    want_losses, want_norms, want_lrs, want_w = peft_clipped(base, init_adapter, steps, 1e-2, max_norm, sched)
    assert min(want_norms) > max_norm  # every step is clipped
    losses, got, stats = trained(
        base, init_adapter, steps, gpus=2, lr_schedule=sched, optim=OptimSpec(lr=1e-2, max_grad_norm=max_norm)
    )
    assert stats["lrs"] == want_lrs
    assert stats["grad_norms"] == pytest.approx(want_norms, rel=1e-5)
    oracle.assert_matches_peft(losses, want_losses, got, want_w)
