"""Real LLaMA checkpoints through disco-ray, with transformers as the oracle.

Tiny random `LlamaForCausalLM`s are made with `save_pretrained` (nothing is downloaded): multi-head
and grouped-query attention, tied and untied embeddings, one file and sharded files, RoPE default
and llama3. Prefill logits must match `model(ids).logits` (float32, relative error <= 1e-4) and
greedy tokens must equal `model.generate(ids, do_sample=False)` exactly, at a capacity with room
for everything and at a tight one that forces offloads and reloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from disco_ray.graph.errors import UsageError  # noqa: E402
from disco_ray.models import LlamaModel  # noqa: E402
from disco_ray.models.graphs import capacity_bounds  # noqa: E402
from tests import family_oracle as oracle  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.ray_fixtures import pool  # noqa: E402, F401  (module fixture for the ray test)
from workloads.llm.checkpoint import Checkpoint  # noqa: E402

PROMPT = [5, 17, 3, 99, 42, 7, 8, 1, 60, 63]
BLOCK = 4  # KV cache block and prefill tile: a 10-token prompt is 3 tiles, generation crosses blocks

CHECKPOINTS = {
    # name: (config overrides, save_pretrained max_shard_size or None)
    "mha": (dict(num_key_value_heads=4, tie_word_embeddings=False), None),
    "gqa_tied_sharded": (dict(num_key_value_heads=2, tie_word_embeddings=True), "40KB"),
    "gqa_llama3": (
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            rope_theta=500000.0,
        ),
        "60KB",
    ),
}


def make_checkpoint(path, seed: int = 0, **overrides):
    """A tiny random LlamaForCausalLM (multi-head attention unless `overrides` say otherwise)."""
    return oracle.save(
        "LlamaForCausalLM", path, seed, **({"num_key_value_heads": 4, "pad_token_id": None} | overrides)
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, (over, shard) in CHECKPOINTS.items():
        path = tmp_path_factory.mktemp(name)
        model = make_checkpoint(path, max_shard_size=shard, **over)
        out[name] = (str(path), model)
    return out


def expected(model, ids, new_tokens):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
        gen = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids)),
        )
    return logits, gen[0, len(ids) :].tolist()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def capacity(path: str, gpus: int, mode: str, new_tokens: int) -> list[int]:
    b = capacity_bounds(path, gpus=gpus, prompt=len(PROMPT), new_tokens=new_tokens, block=BLOCK)
    if mode == "roomy":
        return list(b.roomy)
    return [max(lo + 4096, hi // 8) for lo, hi in zip(b.min, b.roomy)]


def test_checkpoints_are_what_the_tests_say(checkpoints):
    files = {n: {f for f, _, _ in Checkpoint(p).tensors.values()} for n, (p, _) in checkpoints.items()}
    assert len(files["mha"]) == 1 and len(files["gqa_tied_sharded"]) > 1
    ck = Checkpoint(checkpoints["gqa_tied_sharded"][0])
    assert ck.config.tie and ck.config.kv_heads == 2 and "lm_head.weight" not in ck.tensors
    assert Checkpoint(checkpoints["gqa_llama3"][0]).config.rope["rope_type"] == "llama3"


def test_a_relative_checkpoint_path_names_its_files_absolutely(checkpoints, monkeypatch):
    """The workers of a running cluster read the weights from their own working directory."""
    path = Path(checkpoints["mha"][0])
    monkeypatch.chdir(path.parent)
    files = {f for f, _, _ in Checkpoint(path.name).tensors.values()}
    assert files == {str(path / "model.safetensors")}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("mode", ["roomy", "tight"])
def test_prefill_logits_and_greedy_tokens_match_transformers(checkpoints, name, gpus, mode):
    path, hf = checkpoints[name]
    new = 11
    want_logits, want_tokens = expected(hf, PROMPT, new)
    with LlamaModel(
        path, gpus=gpus, capacity=capacity(path, gpus, mode, new), block=BLOCK, engine="local", check=True
    ) as m:
        logits = m.prefill(PROMPT)
        assert logits.shape == want_logits.shape
        assert rel_err(logits, want_logits) <= 1e-4
        gen = m.run_generate(PROMPT, new, stop_at_eos=False)
        assert gen.tokens == want_tokens[: len(gen.tokens)] and len(gen.tokens) == new
        moved = sum(p["bytes_reloaded"] for p in m.plans)
        assert (moved > 0) == (mode == "tight"), m.plans  # tight plans really reload
        # the decode plans are one per cache block reached, not one per token
        decodes = [p["graph"] for p in m.plans if p["graph"].startswith("decode")]
        assert len(decodes) == (len(PROMPT) + new - 2) // BLOCK - len(PROMPT) // BLOCK + 1


def test_generation_stops_at_the_end_of_sequence_token_like_transformers(tmp_path):
    hf = make_checkpoint(tmp_path / "probe", seed=3)
    _, free = expected(hf, PROMPT, 8)
    eos = free[3]  # a token greedy decoding reaches: make it the end of sequence
    hf = make_checkpoint(tmp_path / "ck", seed=3, eos_token_id=eos)
    hf.generation_config.eos_token_id = eos
    _, want = expected(hf, PROMPT, 8)
    assert want[-1] == eos and len(want) <= 4
    with LlamaModel(str(tmp_path / "ck"), capacity=1 << 22, block=BLOCK, engine="local") as m:
        gen = m.run_generate(PROMPT, 8)
        assert gen.tokens == want and gen.stopped == "eos"
        assert m.generate(PROMPT, 8, stop_at_eos=False)[: len(want)] == want


def test_prompts_of_many_lengths_reuse_plans(checkpoints):
    path, hf = checkpoints["gqa_tied_sharded"]
    with LlamaModel(path, capacity=1 << 22, block=BLOCK, engine="local") as m:
        for n in (1, 4, 5, 9):
            ids = PROMPT[:n]
            want_logits, want_tokens = expected(hf, ids, 6)
            assert rel_err(m.prefill(ids), want_logits) <= 1e-4
            assert m.generate(ids, 6, stop_at_eos=False) == want_tokens
        graphs = [p["graph"] for p in m.plans]
        assert len(graphs) == len(set(graphs))  # no graph planned twice


@pytest.mark.ray
def test_the_ray_engine_generates_the_same_tokens(checkpoints, pool):  # noqa: F811
    path, hf = checkpoints["gqa_tied_sharded"]
    want_logits, want_tokens = expected(hf, PROMPT, 5)
    cap = capacity(path, 2, "tight", 5)
    import ray

    from disco_ray.driver.elastic import budget_actor

    with LlamaModel(path, gpus=2, capacity=cap, block=BLOCK, engine="ray", pool=pool) as m:
        assert rel_err(m.prefill(PROMPT), want_logits) <= 1e-4
        # another job asks this one, through a named actor, to run in less memory
        actor = budget_actor("test")
        ray.get(ray.get_actor("disco-budget-test").request.remote([c // 2 for c in cap]))
        m.watch(actor)
        assert m.generate(PROMPT, 5, stop_at_eos=False) == want_tokens
        assert [r["capacity"] for r in m.resizes] == [[c // 2 for c in cap]]
        assert m.resizes[0]["since_request_s"] > 0
        ray.kill(actor)


# ---- refused checkpoints and arguments -------------------------------------------------------
def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(model_type="falcon"), "model_type 'falcon'"),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
            "rope_scaling type 'yarn'",
        ),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(num_key_value_heads=3), "num_key_value_heads 3 does not divide"),
        (dict(hidden_size="64"), "'hidden_size' must be int"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "needs a positive 'factor'"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(checkpoints, tmp_path, edit, message):
    src = checkpoints["mha"][0]
    import shutil

    shutil.copytree(src, tmp_path / "m")
    cfg = _config(tmp_path / "m")
    cfg.update(edit)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match=message):
        Checkpoint(tmp_path / "m")


def test_a_split_that_does_not_divide_and_bad_ids_are_refused(checkpoints):
    path = checkpoints["gqa_tied_sharded"][0]
    with pytest.raises(UsageError, match="num_attention_heads 4 does not split over 3 GPUs"):
        LlamaModel(path, gpus=3, capacity=1 << 20, engine="local")
    with LlamaModel(path, capacity=1 << 20, engine="local") as m:
        with pytest.raises(UsageError, match=r"token id 128 is outside the vocabulary 0\.\.127"):
            m.prefill([1, 128])
        with pytest.raises(UsageError, match="no token ids"):
            m.generate([], 3)


def test_a_missing_tensor_and_a_wrong_shape_are_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoints["mha"][0]
    import shutil

    shutil.copytree(src, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    w = load_file(str(f))
    w["model.norm.weight"] = torch.ones(3)
    save_file(w, str(f))
    with pytest.raises(UsageError, match=r"'model.norm.weight' has shape \[3\], the config says \[64\]"):
        Checkpoint(tmp_path / "m")
    del w["model.norm.weight"]
    save_file(w, str(f))
    with pytest.raises(UsageError, match=r"no tensor 'model\.norm\.weight'"):
        Checkpoint(tmp_path / "m")


# ---- the command line --------------------------------------------------------------------------
def test_cli_generate_prints_tokens_json_and_logits(checkpoints, tmp_path):
    path, hf = checkpoints["gqa_llama3"]
    want_logits, want_tokens = expected(hf, PROMPT, 6)
    ids = ",".join(map(str, PROMPT))
    common = [
        "generate",
        path,
        "--prompt-ids",
        ids,
        "--capacity",
        "256KiB",
        "--engine",
        "local",
        "--block",
        "4",
    ]
    r = run_cli(*common, "--max-new-tokens", "6", "--gpus", "2", "--ignore-eos", "--weights", "disk")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ",".join(map(str, want_tokens))
    out = tmp_path / "logits.npz"
    r = run_cli(*common, "--max-new-tokens", "3", "--json", "--logits", out, "--ignore-eos")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["tokens"] == want_tokens[:3] and doc["decode_steps"] == 2
    assert {"prompt_prefill_s", "decode_tokens_per_s", "bytes_offloaded", "bytes_reloaded", "plans"} <= set(
        doc
    )
    import numpy as np

    logits = torch.from_numpy(np.load(out)["logits"])
    assert logits.dtype == torch.float32 and rel_err(logits, want_logits) <= 1e-4
    # prefill only: the logits of every prompt position and no token
    with LlamaModel(path, capacity=1 << 20, block=4, engine="local") as m:
        gen = m.run_generate(PROMPT, 0, prefill_logits=True)
    assert gen.tokens == [] and rel_err(gen.prefill_logits, want_logits) <= 1e-4


def in_process(capsys, *args) -> tuple[int, str]:
    """`disco-ray ARGS` run by the CLI's entry point in this process (the subprocess tests above
    and below check the real exit status and stderr): its exit status and stderr."""
    from disco_ray.cli.app import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "2"], "one of the arguments --budget-file --capacity is required"),
        (["--max-new-tokens", "-1", "--capacity", "1MiB"], "--max-new-tokens must be >= 0"),
        (["--max-new-tokens", "2", "--capacity", "1KiB"], "whose capacity is 1024 bytes"),
        (["--max-new-tokens", "2", "--capacity", "1MiB", "--gpus", "3"], "does not split over 3 GPUs"),
        (["--max-new-tokens", "2", "--capacity", "1MiB", "--logits", "x.txt"], "written as .npz"),
    ],
)
def test_cli_generate_refuses_bad_input_in_one_line(checkpoints, capsys, args, message):
    rc, err = in_process(
        capsys, "generate", checkpoints["mha"][0], "--prompt-ids", "1,2", "--engine", "local", *args
    )
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("disco-ray: error:") and message in lines[0], err


def test_cli_generate_names_what_a_directory_lacks(checkpoints, tmp_path, capsys):
    args = ["--prompt-ids", "1", "--max-new-tokens", "1", "--capacity", "1MiB", "--engine", "local"]
    rc, err = in_process(capsys, "generate", tmp_path, *args)
    assert rc == 2 and "config.json: missing" in err
    (tmp_path / "config.json").write_text((Path(checkpoints["mha"][0]) / "config.json").read_text())
    rc, err = in_process(capsys, "generate", tmp_path, *args)
    assert rc == 2 and "no model.safetensors or model.safetensors.index.json" in err
    rc, err = in_process(capsys, "generate", tmp_path / "nope", *args)
    assert rc == 2 and "not a checkpoint directory" in err


def test_cli_generate_takes_a_text_prompt_with_the_checkpoints_tokenizer(checkpoints, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    import shutil

    path, hf = checkpoints["mha"]
    shutil.copytree(path, tmp_path / "m")
    words = ["<unk>", *(f"w{i}" for i in range(1, 128))]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    _, want = expected(hf, PROMPT, 4)
    text = " ".join(words[i] for i in PROMPT)
    r = run_cli(
        "generate", tmp_path / "m", "--prompt", text, "--max-new-tokens", "4", "--capacity", "1MiB",
        "--engine", "local", "--block", "4", "--ignore-eos", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["tokens"] == want and doc["prompt_tokens"] == len(PROMPT)
    assert doc["text"].split() == [words[i] for i in want]
    r = run_cli("generate", path, "--prompt", "w1 w2", "--max-new-tokens", "1", "--capacity", "1MiB")
    assert r.returncode == 2 and "tokenizer.json, which is missing" in r.stderr


# ---- elastic capacity --------------------------------------------------------------------------
class ScriptedBudget:
    """A budget that asks for capacity `plan[k]` at its k-th poll (None: no change)."""

    def __init__(self, plan):
        from disco_ray.driver.elastic import Budget

        self.plan, self.budget, self.polls = list(plan), Budget(), 0

    def poll(self):
        if self.polls < len(self.plan) and self.plan[self.polls] is not None:
            self.budget.request(self.plan[self.polls])
        self.polls += 1
        return self.budget


def test_capacity_shrinks_and_grows_between_decode_steps_with_the_same_tokens(checkpoints):
    path, hf = checkpoints["gqa_tied_sharded"]
    _, want = expected(hf, PROMPT, 9)
    b = capacity_bounds(path, gpus=2, prompt=len(PROMPT), new_tokens=9, block=BLOCK)
    roomy, small = b.roomy[0], max(b.min[0] + 2048, b.roomy[0] // 4)
    with LlamaModel(path, gpus=2, capacity=roomy, block=BLOCK, engine="local", check=True) as m:
        tiny = b.min[0] // 2  # below what one vertex needs: the plan runs at that minimum
        m.watch(ScriptedBudget([None, small, None, None, roomy, None, tiny]))
        gen = m.run_generate(PROMPT, 9, stop_at_eos=False)
        assert gen.tokens == want
        assert [r["capacity"][0] for r in m.resizes] == [small, roomy, tiny] and m.clamped >= 1
        assert all(len(s.arenas) == 1 for s in m.pool.stores.values())  # the others were freed
        m.watch(None)
        m.resize(small)
        assert m.generate(PROMPT, 9, stop_at_eos=False) == want
        made = [(p["graph"], tuple(p["capacity"])) for p in m.plans]
        assert len(made) == len(set(made))  # plans are kept per capacity: none was made twice


def test_cli_generate_follows_a_budget_file(checkpoints, tmp_path):
    path, hf = checkpoints["mha"]
    _, want = expected(hf, PROMPT, 4)
    (tmp_path / "budget").write_text("128KiB")
    r = run_cli(
        "generate", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "4",
        "--budget-file", tmp_path / "budget", "--engine", "local", "--block", "4", "--ignore-eos", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["tokens"] == want and doc["resizes"] == []
    (tmp_path / "budget").write_text("lots")
    r = run_cli(
        "generate", path, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--budget-file", tmp_path / "budget"
    )
    assert r.returncode == 2 and "--budget-file" in r.stderr and "bad size 'lots'" in r.stderr
