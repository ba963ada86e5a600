"""The checks every model family passes against its transformers class (and peft), shared by
the family test modules (tests/test_family_*.py).

`save` makes a tiny random checkpoint of any transformers causal-LM class with `save_pretrained`
(weights scaled up so greedy choices are clear); `check_generate` compares prefill logits (within
1e-4) and greedy tokens (equal) at a roomy or tight capacity, on either engine; `check_batch` a
ragged batch's tokens with each prompt's own greedy decoding; `check_finetune` LoRA losses and
adapter weights after several AdamW steps with peft's.
"""

from __future__ import annotations

import torch

from disco_ray.models import LlamaModel
from disco_ray.models.finetune import LoraTrainer
from disco_ray.models.graphs import capacity_bounds
from planner import min_capacity, roomy_capacity
from workloads.llm.checkpoint import Checkpoint
from workloads.llm.train import LoraSpec, OptimSpec, train_graph

BLOCK = 4  # KV cache block and prefill tile: a 10-token prompt is 3 tiles
PROMPT = [5, 17, 3, 99, 42, 7, 8, 1, 60, 63]
PROMPTS = [PROMPT, [9, 4, 77, 31, 2 + 1], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def save(arch: str, path, seed: int = 0, scale: float = 4.0, max_shard_size: str | None = None, **overrides):
    """A tiny random `transformers.<arch>` (e.g. "MistralForCausalLM") saved at `path`; its
    config is `BASE` with `overrides`; `max_shard_size`: sharded files. Returns the model (eval mode)."""
    import transformers

    model_cls = getattr(transformers, arch)
    cfg = model_cls.config_class(**(BASE | overrides))
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # larger weights than the init's: logits far apart, greedy choices clear
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens: the argmax of a full forward per step (no cache shortcuts)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def capacity(path: str, gpus: int, mode: str, prompt: int, new: int, batch: int = 1) -> list[int]:
    """Roomy: every tensor of the largest graph at once; tight: an eighth of it (offloads)."""
    b = capacity_bounds(path, gpus=gpus, prompt=prompt, new_tokens=new, block=BLOCK, batch=batch)
    if mode == "roomy":
        return list(b.roomy)
    return [max(lo + 4096, hi // 8) for lo, hi in zip(b.min, b.roomy)]


def check_generate(path: str, hf, gpus: int, mode: str, new: int = 9, engine: str = "local", pool=None):
    """Prefill logits within 1e-4 and `new` greedy tokens equal to transformers'; a tight
    capacity must really reload."""
    with torch.no_grad():
        want_logits = hf(torch.tensor([PROMPT])).logits[0]
    want = greedy(hf, PROMPT, new)
    cap = capacity(path, gpus, mode, len(PROMPT), new)
    kw = {"pool": pool} if pool is not None else {"check": True}
    with LlamaModel(path, gpus=gpus, capacity=cap, block=BLOCK, engine=engine, **kw) as m:
        logits = m.prefill(PROMPT)
        assert logits.shape == want_logits.shape
        assert rel_err(logits, want_logits) <= 1e-4
        assert m.generate(PROMPT, new, stop_at_eos=False) == want
        assert (sum(p["bytes_reloaded"] for p in m.plans) > 0) == (mode == "tight"), m.plans


def check_batch(path: str, hf, gpus: int, mode: str, new: tuple[int, ...] = (6, 9, 7)):
    """A ragged batch: each prompt's last prefill logits and greedy tokens are its own."""
    want = [greedy(hf, p, n) for p, n in zip(PROMPTS, new)]
    cap = capacity(path, gpus, mode, max(map(len, PROMPTS)), max(new), batch=len(PROMPTS))
    with LlamaModel(path, gpus=gpus, capacity=cap, block=BLOCK, engine="local") as m:
        for row, p in zip(m.prefill_batch(PROMPTS), PROMPTS):
            with torch.no_grad():
                assert rel_err(row, hf(torch.tensor([p])).logits[0, -1]) <= 1e-4
        assert m.generate(PROMPTS, list(new), stop_at_eos=False) == want


def random_adapter(base: str, arch: str, targets: list[str], path, seed: int = 7) -> str:
    """A peft LoRA adapter (r 4, alpha 8) on `targets` with random A and B, saved at `path`."""
    import peft
    import transformers

    model = getattr(transformers, arch).from_pretrained(base)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")
    pm = peft.get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    pm.save_pretrained(path)
    return str(path)


def peft_train(
    base: str,
    arch: str,
    adapter_path: str,
    data: torch.Tensor,
    steps: int,
    lr: float = 1e-2,
    optim: str = "adamw",
    weight_decay: float = 0.0,
    batch: int | None = None,
):
    """peft + torch AdamW (or SGD) for `steps` steps, each on `batch` rows of `data` in turn (all
    by default): losses and the adapter's weights by disco-ray's names."""
    import peft
    import transformers

    from disco_ray.models import adapter

    model = getattr(transformers, arch).from_pretrained(base)
    pm = peft.PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    params = [p for p in pm.parameters() if p.requires_grad]
    opt_cls = torch.optim.AdamW if optim == "adamw" else torch.optim.SGD
    opt = opt_cls(params, lr=lr, weight_decay=weight_decay)
    n = data.shape[0]
    batch = batch or n
    losses = []
    for k in range(steps):
        x = data[[(k * batch + i) % n for i in range(batch)]]
        loss = pm(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    weights = {
        adapter.PREFIX + n.split("model.layers.", 1)[1].replace(".default", ""): p.detach().clone()
        for n, p in pm.named_parameters()
        if "lora_" in n
    }
    return losses, weights


def check_finetune(base: str, arch: str, targets: list[str], adapter_path: str, gpus: int, mode: str):
    """Three AdamW steps of LoRA on `targets`: losses and adapter weights equal to peft's."""
    data = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    want_losses, want_w = peft_train(base, arch, adapter_path, data, steps=3)
    tg = train_graph(
        Checkpoint(base),
        1,
        2,
        9,
        BLOCK,
        LoraSpec(rank=4, alpha=8, targets=tuple(targets)),
        OptimSpec(lr=1e-2),
    ).taskgraph
    cap = train_capacity(tg, mode)
    with LoraTrainer(
        base, gpus=gpus, capacity=cap, init_adapter=adapter_path, optim=OptimSpec(lr=1e-2),
        block=BLOCK, engine="local", check=True,
    ) as tr:  # fmt: skip
        losses = tr.train(data, steps=3)
        got = tr.adapter()
        if mode == "tight":
            assert sum(p["bytes_reloaded"] for p in tr.plans) > 0, tr.plans
    assert_matches_peft(losses, want_losses, got, want_w)


def peft_model(base: str, arch: str, weights: dict[str, torch.Tensor], r: int = 4, alpha: float = 8):
    """A peft model of `base` (eval mode) whose LoRA matrices are `weights`, by disco-ray's keys
    (as `peft_train` returns them)."""
    import peft
    import transformers

    from disco_ray.models import adapter

    targets = sorted({k.split(".")[-3] for k in weights})
    model = getattr(transformers, arch).from_pretrained(base)
    cfg = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(weights[adapter.PREFIX + n.split("model.layers.", 1)[1].replace(".default", "")])
    return pm.eval()


def check_finetune_rows(
    base: str,
    arch: str,
    targets: list[str],
    adapter_path: str,
    gpus: int,
    mode: str,
    data: torch.Tensor,
    save_to,
):
    """`check_finetune` with one row of `data` per AdamW step (each step its own tokens, so a
    mixture's routes differ between steps); then the adapter saved at `save_to` loads into peft
    with the trained weights."""
    import peft
    import transformers

    n, seq = data.shape
    want_losses, want_w = peft_train(base, arch, adapter_path, data, steps=n, batch=1)
    tg = train_graph(
        Checkpoint(base), 1, 1, seq, BLOCK, LoraSpec(rank=4, alpha=8, targets=tuple(targets)), OptimSpec()
    )
    roomy, least = roomy_capacity(tg.taskgraph)[0], min_capacity(tg.taskgraph)[0]
    cap = roomy if mode == "roomy" else max(least * 2, roomy // 10)
    with LoraTrainer(
        base, gpus=gpus, capacity=cap, init_adapter=adapter_path, optim=OptimSpec(lr=1e-2),
        block=BLOCK, engine="local", check=True,
    ) as tr:  # fmt: skip
        losses = tr.train(data, steps=n, batch=1)
        got = tr.adapter()
        tr.save_adapter(str(save_to))
    assert_matches_peft(losses, want_losses, got, want_w)
    pm = peft.PeftModel.from_pretrained(getattr(transformers, arch).from_pretrained(base), str(save_to))
    from disco_ray.models import adapter

    loaded = {
        adapter.PREFIX + k.split("model.layers.", 1)[1].replace(".default", ""): p
        for k, p in pm.named_parameters()
        if "lora_" in k
    }
    assert set(loaded) == set(got)
    for k, w in got.items():
        torch.testing.assert_close(loaded[k], w, rtol=0, atol=0, msg=k)


def train_capacity(tg, mode: str) -> int:
    """A training graph's capacity: roomy (every tensor at once) or tight (offloads)."""
    if mode == "roomy":
        return roomy_capacity(tg)[0]
    return max(min_capacity(tg)[0] * 2, roomy_capacity(tg)[0] // 10)


def assert_matches_peft(losses, want_losses, got: dict, want_w: dict) -> None:
    """Each step's loss within 1e-4 (relative) and every adapter matrix within float32 tolerance."""
    for a, b in zip(losses, want_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, want_losses)
    assert set(got) == set(want_w)
    for k, w in want_w.items():
        torch.testing.assert_close(got[k], w, rtol=2e-4, atol=2e-5, msg=k)
