"""Fine-tuning data, evaluation and progress: JSONL documents tokenized as transformers' fast
tokenizer does and packed with EOS between them, bad lines named by number; the forward-only
evaluation graph's loss equal to transformers' (peft's) forward loss, with no backward or
optimizer vertex and the adapter left as it was; a record per step as it ends; `disco-ray
finetune` end to end (progress on stderr, --json, --eval-every, --steps 0, the files' mode).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from disco_ray.cli import main  # noqa: E402
from disco_ray.graph.errors import UsageError  # noqa: E402
from disco_ray.graph.files import new_directory, write_bytes  # noqa: E402
from disco_ray.models.finetune import LoraTrainer  # noqa: E402
from disco_ray.models.textdata import load_tokens  # noqa: E402
from tests import family_oracle as oracle  # noqa: E402
from tests.ray_fixtures import pool  # noqa: E402, F401  (module fixture for the ray test)
from workloads.llm.train import OptimSpec  # noqa: E402

ARCH = "LlamaForCausalLM"
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
BLOCK = 4
WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)]
BACKWARD = {"adamw", "sgd"}  # and every op named *_grad, and attention_stats (the backward's)


def save_tokenizer(path, eos: str | None = "</s>") -> None:
    """A word-level tokenizer.json whose post-processor adds BOS (<s>), as LLaMA's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "unk_token": "<unk>"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg | ({"eos_token": eos} if eos else {})))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    oracle.save(ARCH, path, seed=5, tie_word_embeddings=False)
    save_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def init_adapter(base, tmp_path_factory):
    return oracle.random_adapter(base, ARCH, TARGETS, tmp_path_factory.mktemp("adapter"))


def write_jsonl(path, docs) -> str:
    path.write_text("".join(d if isinstance(d, str) else json.dumps(d) + "\n" for d in docs))
    return str(path)


def test_documents_are_tokenized_as_transformers_does_and_packed_with_eos(base, tmp_path):
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{base}/tokenizer.json")
    texts = ["w1 w2 w3", "w4 w5 w6 w7 w8 w9 w10", "w11"]
    docs = [
        {"text": texts[0]},
        {"ids": [9, 8, 7, 2]},
        "\n",
        {"text": texts[1], "meta": 3},
        {"text": texts[2]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    flat = [*fast(texts[0])["input_ids"], 2, 9, 8, 7, 2, *fast(texts[1])["input_ids"], 2]
    flat += [*fast(texts[2])["input_ids"], 2]  # an "ids" document ending with EOS gets no second one
    assert fast(texts[0])["input_ids"] == [1, 5, 6, 7]  # the BOS the tokenizer adds is kept
    got = load_tokens(path, base, seq_len=5)
    assert got.dtype == torch.int64
    assert got.tolist() == torch.tensor(flat[: len(flat) // 5 * 5]).reshape(-1, 5).tolist()

    no_eos = tmp_path / "ck"  # no eos_token_id in config.json: the tokenizer's eos_token
    shutil.copytree(base, no_eos)
    cfg = json.loads((no_eos / "config.json").read_text())
    cfg.pop("eos_token_id")
    (no_eos / "config.json").write_text(json.dumps(cfg))
    assert torch.equal(load_tokens(path, no_eos, seq_len=5), got)
    save_tokenizer(no_eos, eos=None)
    with pytest.raises(UsageError, match="needs an end-of-sequence id"):
        load_tokens(path, no_eos, seq_len=5)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"text": "w1"', "malformed JSON"),
        ('{"txt": "w1"}', 'give exactly one of "text" and "ids"'),
        ('{"text": "w1", "ids": [3]}', 'give exactly one of "text" and "ids"'),
        ('{"text": 5}', '"text" must be a string'),
        ('{"ids": [1, "2"]}', '"ids" must be a list of integer'),
        ('{"ids": [1, true]}', '"ids" must be a list of integer'),
        ('{"ids": [1, 128]}', r'"ids": token id 128 is outside the vocabulary 0\.\.127'),
        ('{"ids": []}', "an empty document"),
        ("[1, 2]", "want a JSON object"),
    ],
)
def test_a_bad_jsonl_line_is_named_by_its_line_number(base, tmp_path, line, says):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "w1 w2"}, "\n", line + "\n", {"ids": [3]}])
    with pytest.raises(UsageError, match=f"^{re.escape(path)}:3: {says}"):
        load_tokens(path, base, seq_len=4)


def test_text_without_a_tokenizer_and_short_or_unsized_data_are_refused(base, tmp_path):
    bare = tmp_path / "ck"
    shutil.copytree(base, bare)
    (bare / "tokenizer.json").unlink()
    path = write_jsonl(tmp_path / "d.jsonl", [{"ids": [3, 4]}, {"text": "w1"}])
    with pytest.raises(
        UsageError, match=f'^{path}:2: a "text" line needs .*tokenizer.json, which is missing'
    ):
        load_tokens(path, bare, seq_len=2)
    with pytest.raises(UsageError, match="5 tokens in all, fewer than one row of --seq-len 8"):
        load_tokens(write_jsonl(tmp_path / "s.jsonl", [{"ids": [3, 4]}, {"ids": [5]}]), base, seq_len=8)
    with pytest.raises(UsageError, match="give --seq-len"):
        load_tokens(path, base)


def test_eval_loss_equals_the_forward_loss_of_peft_and_leaves_the_adapter(base, init_adapter):
    rows = torch.randint(0, 128, (5, 9), generator=torch.Generator().manual_seed(3))
    with LoraTrainer(
        base,
        capacity=1 << 24,
        init_adapter=init_adapter,
        optim=OptimSpec(lr=1e-2),
        block=BLOCK,
        engine="local",
    ) as tr:
        before = tr.evaluate(rows, batch=2)  # batches of 2, 2, 1: two shapes, each planned once
        start = tr.adapter()
        again = tr.evaluate(rows, batch=2)
        kept = tr.adapter()
        assert [p["graph"] for p in tr.plans] == ["eval/2x9", "eval/1x9"]
        for key, (graph, _) in tr._programs.items():
            tg = graph.taskgraph
            ops = {v.op for v in tg.vertices.values()}
            assert not ops & BACKWARD and not any(
                o and (o.endswith("_grad") or o == "attention_stats") for o in ops
            )
            assert tg.carry == {}, key  # no state saved: the adapter is only read
        tr.train(rows[:2], steps=1)
        trained = tr.adapter()
        after = tr.evaluate(rows)
    assert all(torch.equal(start[k], kept[k]) for k in start)
    assert again.loss == before.loss and (before.rows, before.tokens) == (5, 5 * 8)
    want = peft.PeftModel.from_pretrained(
        getattr(transformers, ARCH).from_pretrained(base), init_adapter
    ).eval()
    with torch.no_grad():
        assert abs(before.loss - want(input_ids=rows, labels=rows).loss.item()) <= 1e-5
        now = oracle.peft_model(base, ARCH, trained)(input_ids=rows, labels=rows).loss.item()
    assert abs(after.loss - now) <= 1e-5 and after.loss != before.loss
    assert after.perplexity == pytest.approx(
        torch.exp(torch.tensor(now, dtype=torch.float64)).item(), rel=1e-5
    )


@pytest.mark.ray
def test_the_ray_engine_evaluates_the_adapter_its_steps_left(base, init_adapter, pool):  # noqa: F811
    rows = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    with LoraTrainer(
        base, gpus=2, capacity=1 << 24, init_adapter=init_adapter, optim=OptimSpec(lr=1e-2), block=BLOCK,
        engine="ray", pool=pool,
    ) as tr:  # fmt: skip
        tr.train(rows, steps=1)
        got = tr.evaluate(rows)
        trained = tr.adapter()
    with torch.no_grad():
        want = oracle.peft_model(base, ARCH, trained)(input_ids=rows, labels=rows).loss.item()
    assert abs(got.loss - want) <= 1e-5


def test_each_step_is_reported_as_it_ends(base):
    rows = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(4))
    seen = []
    with LoraTrainer(base, capacity=1 << 24, optim=OptimSpec(lr=1e-3), block=BLOCK, engine="local") as tr:

        def on_step(rec):  # called inside train, before the next step: it may evaluate
            seen.append((rec, len(tr.losses), tr.evaluate(rows[:1]).loss))

        losses = tr.train(rows, steps=3, batch=2, on_step=on_step)
    assert [r.step for r, _, _ in seen] == [1, 2, 3] and [n for _, n, _ in seen] == [1, 2, 3]
    assert [r.loss for r, _, _ in seen] == losses
    assert all(r.lr == 1e-3 and r.tokens == 2 * 8 and r.seconds > 0 for r, _, _ in seen)
    assert seen[0][0].tokens_per_s == pytest.approx(16 / seen[0][0].seconds)
    assert set(seen[0][0].as_dict()) == {"step", "loss", "lr", "tokens_per_s", "seconds"}


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_output_files_take_the_umask_at_the_time_of_writing(tmp_path):
    old = os.umask(0o077)
    try:
        write_bytes(tmp_path / "private", b"x")
        os.umask(0o022)
        write_bytes(tmp_path / "shared", b"x")
        with new_directory(tmp_path / "dir") as into:
            write_bytes(into / "f", b"x")
    finally:
        os.umask(old)
    assert (mode(tmp_path / "private"), mode(tmp_path / "shared")) == (0o600, 0o644)
    assert (mode(tmp_path / "dir"), mode(tmp_path / "dir" / "f")) == (0o755, 0o644)


def test_cli_trains_on_jsonl_evaluates_and_reports_each_step(base, init_adapter, tmp_path, capsys):
    gen = torch.Generator().manual_seed(6)
    docs = [
        {"text": " ".join(f"w{int(i)}" for i in torch.randint(0, 60, (7,), generator=gen))} for _ in range(6)
    ]
    train = write_jsonl(tmp_path / "train.jsonl", docs[:4])
    held = write_jsonl(tmp_path / "held.jsonl", docs[4:])
    common = ["--capacity", "4MiB", "--engine", "local", "--block", str(BLOCK), "--seq-len", "8"]
    old = os.umask(0o022)
    try:
        rc = main(
            ["finetune", base, "--data", train, "--init-adapter", init_adapter, "--steps", "3", "--lr", "0.01",
             "--batch", "2", "--eval-data", held, "--eval-every", "2", "--out", str(tmp_path / "out"), "--json",
             *common]
        )  # fmt: skip
    finally:
        os.umask(old)
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    assert [s["step"] for s in doc["steps"]] == [1, 2, 3] and [s["loss"] for s in doc["steps"]] == doc[
        "losses"
    ]
    assert all(s["lr"] == 0.01 and s["tokens_per_s"] > 0 for s in doc["steps"])
    assert [e["step"] for e in doc["eval"]] == [2, 3] and doc["step_s"] and doc["out"]
    lines = err.splitlines()
    assert [ln.split(":")[0] for ln in lines if " loss " in ln] == [
        "step 1/3",
        "step 2/3",
        "step 2",
        "step 3/3",
        "step 3",
    ]
    assert all(mode(f) == 0o644 for f in (tmp_path / "out").iterdir()) and mode(tmp_path / "out") == 0o755

    held_rows = load_tokens(held, base, seq_len=8)
    with torch.no_grad():  # the adapter written, evaluated by peft on the held-out rows
        pm = peft.PeftModel.from_pretrained(
            getattr(transformers, ARCH).from_pretrained(base), str(tmp_path / "out")
        )
        want = pm.eval()(input_ids=held_rows, labels=held_rows).loss.item()
    assert abs(doc["eval"][-1]["loss"] - want) <= 1e-5

    rc = main(
        [
            "finetune",
            base,
            "--steps",
            "0",
            "--eval-data",
            held,
            "--init-adapter",
            str(tmp_path / "out"),
            *common,
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith("eval at step 0: loss ") and abs(float(out.split()[5]) - want) <= 1e-5

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "w1"}, '{"ids": [1, 500]}\n'])
    for argv, says in (
        (["--data", bad, "--steps", "1", "--lr", "0.1", "--out", str(tmp_path / "o2")], f"{bad}:2: "),
        (["--steps", "0", "--eval-data", held, "--out", str(tmp_path / "o3")], "--out with --steps 0"),
        (["--steps", "0"], "give --eval-data"),
        (["--data", train, "--steps", "1", "--out", str(tmp_path / "o4")], "--lr is needed to train"),
    ):
        assert main(["finetune", base, *argv, *common]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    assert not any(p.name.startswith("o") and p.name != "out" for p in tmp_path.iterdir())
