"""`disco-ray generate --prompts FILE.jsonl --batch N`: requests in, a result line per sequence out.

The command runs in this process (`main` with capsys, as tests/test_cli.py's in-process checks
do) on the local engine with a tiny random checkpoint, so each case costs milliseconds; its
greedy tokens are checked against transformers'. Every bad input is refused before the model
loads, with one line, exit 2 and no output file; a run that fails keeps only whole lines.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from disco_ray.cli.app import main  # noqa: E402
from disco_ray.cli.prompts import LineSink, Request, Results  # noqa: E402
from disco_ray.graph.errors import RunError  # noqa: E402
from disco_ray.models import LlamaModel  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.test_models import expected, make_checkpoint  # noqa: E402

WORDS = ["<unk>", *(f"w{i}" for i in range(1, 128))]  # a word per id of the 128-token vocabulary
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 1, 60, 63], [9, 4], [33, 12, 77, 101, 6]]
RUN = ["--capacity", "1MiB", "--engine", "local", "--block", "4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(a checkpoint with tokenizer.json, the same without one, the transformers model)."""
    bare = tmp_path_factory.mktemp("bare")
    hf = make_checkpoint(bare)
    with_tok = tmp_path_factory.mktemp("tok")
    shutil.copytree(bare, with_tok, dirs_exist_ok=True)
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(with_tok / "tokenizer.json"))
    return str(with_tok), str(bare), hf


@pytest.fixture(scope="module")
def want(ckpt):
    """transformers' greedy tokens of each prompt alone (8 new tokens, no stop)."""
    return [expected(ckpt[2], ids, 8)[1] for ids in PROMPTS]


def jsonl(path: Path, *docs) -> Path:
    path.write_text("".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in docs))
    return path


def run(capsys, *args) -> tuple[int, str, str]:
    code = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def lines_of(text: str) -> list[dict]:
    return [json.loads(ln) for ln in text.splitlines()]


# ---- bad input: one line, exit 2, nothing written, before the model loads -------------------------
BAD_LINES = [
    ({"ids": []}, "p.jsonl:2: empty prompt (no ids)"),
    ({"text": ""}, "p.jsonl:2: empty prompt (the text tokenizes to no ids)"),
    ({"ids": [1, 128]}, 'p.jsonl:2: "ids": token id 128 is outside the vocabulary 0..127'),
    ({"ids": [-1]}, "token id -1 is outside the vocabulary 0..127"),
    ({"ids": [1, 2.5]}, '"ids" must be a list of integer token ids'),
    ({"ids": [True]}, '"ids" must be a list of integer token ids'),
    ('{"ids": [1, 2]', "p.jsonl:2: malformed JSON"),
    ("[1, 2]", "p.jsonl:2: want a JSON object"),
    ({"max_new_tokens": 3}, 'p.jsonl:2: give exactly one of "ids" and "text"'),
    ({"ids": [1], "text": "w1"}, 'give exactly one of "ids" and "text"'),
    ({"ids": [1], "prompt": "w1"}, "p.jsonl:2: unknown field 'prompt'"),
    ({"text": 5}, '"text" must be a string'),
    ({"ids": [1], "max_new_tokens": 0}, '"max_new_tokens" must be an integer >= 1, got 0'),
    ({"ids": [1], "max_new_tokens": "3"}, '"max_new_tokens" must be an integer >= 1'),
    ({"ids": [1], "stop_ids": [200]}, '"stop_ids": token id 200 is outside the vocabulary'),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_a_bad_line_is_named_by_its_line_number(ckpt, tmp_path, capsys, line, message):
    prompts = jsonl(tmp_path / "p.jsonl", {"ids": [1, 2]}, line, {"ids": [3]})
    assert_refused(capsys, tmp_path, ckpt[0], "--prompts", prompts, message=message)


BAD_OPTIONS = [
    (["--temperature", "0"], "--temperature must be > 0 when sampling, got 0.0"),
    (["--do-sample", "--temperature", "-1"], "--temperature must be > 0 when sampling"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-k", "-1"], "--top-k must be an integer >= 0 (0: off), got -1"),
    (["--temperature", "nan"], "argument --temperature: want a finite number"),
    (["--batch", "0"], "argument --batch: want a positive integer, got '0'"),
    (["--batch", "-3"], "argument --batch: want a positive integer"),
    (["--stop-ids", "1,500"], "--stop-ids: stop id 500 is outside the vocabulary of 128 tokens"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1 with --prompts, got 0"),
    (["--logits", "x.npz"], "--logits takes one prompt"),
    (["--stats", "s.txt"], "the statistics are written as .json"),
    (["--do-sample", "--greedy"], "not allowed with argument"),
    (["--steps-per-call", "0"], "argument --steps-per-call: want a positive integer, got '0'"),
]


@pytest.mark.parametrize("args, message", BAD_OPTIONS)
def test_a_bad_option_is_refused_in_one_line(ckpt, tmp_path, capsys, args, message):
    prompts = jsonl(tmp_path / "p.jsonl", {"ids": [1, 2]})
    assert_refused(capsys, tmp_path, ckpt[0], "--prompts", prompts, *args, message=message)


def test_text_without_a_tokenizer_and_no_max_new_tokens_are_refused(ckpt, tmp_path, capsys):
    prompts = jsonl(tmp_path / "p.jsonl", {"ids": [1, 2]}, {"text": "w1 w2"})
    need = f'p.jsonl:2: "text" needs {Path(ckpt[1]) / "tokenizer.json"}, which is missing'
    assert_refused(capsys, tmp_path, ckpt[1], "--prompts", prompts, message=need)
    args = ["--prompts", prompts, *RUN, "--out", tmp_path / "out.jsonl"]
    code, _, err = run(capsys, ckpt[0], *args)
    assert code == 2 and 'p.jsonl:1: no "max_new_tokens" and no --max-new-tokens' in err
    blank = jsonl(tmp_path / "blank.jsonl", "", "  ")
    assert_refused(capsys, tmp_path, ckpt[0], "--prompts", blank, message="no prompts")


@pytest.mark.parametrize("where", ["missing_dir/out.jsonl", "."])
def test_an_unwritable_out_is_refused_before_anything_runs(ckpt, tmp_path, capsys, where):
    prompts = jsonl(tmp_path / "p.jsonl", {"ids": [1, 2]})
    out = tmp_path / where
    code, stdout, err = run(
        capsys, ckpt[0], "--prompts", prompts, "--max-new-tokens", "2", *RUN, "--out", out
    )
    assert code == 2 and err.startswith("disco-ray: error: --out ") and len(err.splitlines()) == 1, err
    assert stdout == "" and not list(tmp_path.rglob("*.partial"))


def test_the_options_of_a_file_are_refused_with_one_prompt(ckpt, tmp_path, capsys):
    for args, message in [
        (["--batch", "2"], "--batch takes --prompts"),
        (["--out", tmp_path / "o.jsonl"], "--out takes --prompts"),
        (["--progress"], "--progress takes --prompts"),
        ([], "--max-new-tokens is required"),
        (
            ["--max-new-tokens", "2", "--prompt-ids", "1,500"],
            "--prompt-ids: token id 500 is outside the vocabulary",
        ),
        (["--max-new-tokens", "2", "--temperature", "0"], "--temperature must be > 0 when sampling"),
    ]:
        code, _, err = run(capsys, ckpt[0], "--prompt-ids", "1,2", *RUN, *args)
        assert code == 2 and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "prompt, args, message",
    [
        (["--prompt-ids", ""], [], "argument --prompt-ids: no token ids given"),
        (["--prompt", ""], [], "--prompt: empty prompt (the text tokenizes to no ids)"),
        (["--prompt-ids", "1,128"], [], "--prompt-ids: token id 128 is outside the vocabulary 0..127"),
        (["--prompt-ids", "1,2"], ["--do-sample", "--temperature", "0"], "--temperature must be > 0"),
        (["--prompt-ids", "1,2"], ["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--prompt-ids", "1,2"], ["--top-p", "1.01"], "--top-p must be in (0, 1], got 1.01"),
    ],
)
def test_one_bad_prompt_is_refused_in_one_line_and_writes_nothing(
    ckpt, tmp_path, capsys, prompt, args, message
):
    logits = tmp_path / "logits.npz"
    code, stdout, err = run(
        capsys, ckpt[0], *prompt, "--max-new-tokens", "2", *RUN, *args, "--logits", logits
    )
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert stdout == "" and list(tmp_path.iterdir()) == []


def assert_refused(capsys, tmp_path, model, *args, message: str) -> None:
    out = tmp_path / "out.jsonl"
    n = [] if "--max-new-tokens" in args else ["--max-new-tokens", "2"]  # unless the case gives its own
    code, stdout, err = run(capsys, model, *args, *n, *RUN, "--out", out)
    assert code == 2, (code, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("disco-ray: error: "), err
    assert message in lines[0], (message, lines[0])
    assert stdout == "" and not out.exists() and not Path(f"{out}.partial").exists()


# ---- the round trip --------------------------------------------------------------------------------
def test_greedy_results_equal_transformers_per_prompt_and_come_as_sequences_finish(
    ckpt, want, tmp_path, capsys, monkeypatch
):
    stop = want[0][3]  # line 0 stops at its own stop id, at its first occurrence
    prompts = jsonl(
        tmp_path / "p.jsonl",
        {"ids": PROMPTS[0], "stop_ids": [stop]},
        "",  # skipped: indices count prompts
        {"text": " ".join(WORDS[i] for i in PROMPTS[1]), "max_new_tokens": 5},
        {"ids": PROMPTS[2]},
    )
    out = tmp_path / "out.jsonl"
    seen = []  # per sequence the model finished: (its index in the file, the indices on disk then)
    real = LlamaModel.run_generate_batch

    def watched(self, prompts, n, **kw):
        first, cli_finish = 2 * len(calls), kw["on_finish"]  # --batch 2
        calls.append(kw["steps_per_call"])

        def on_finish(seq):
            cli_finish(seq)
            text = Path(f"{out}.partial").read_text()
            assert text.endswith("\n")  # whole lines only
            seen.append((first + seq.index, [d["index"] for d in lines_of(text)]))

        return real(self, prompts, n, **{**kw, "on_finish": on_finish})

    calls: list[int] = []
    monkeypatch.setattr(LlamaModel, "run_generate_batch", watched)
    args = [
        "--prompts",
        prompts,
        "--batch",
        "2",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--steps-per-call",
        "3",
    ]
    args += RUN
    code, stdout, err = run(capsys, ckpt[0], *args, "--out", out, "--json")
    assert code == 0, err
    assert stdout == "" and not Path(f"{out}.partial").exists()
    assert calls == [3, 3]  # --steps-per-call reaches each batch's decoding
    got = {d["index"]: d for d in lines_of(out.read_text())}
    assert sorted(got) == [0, 1, 2]
    cut = want[0].index(stop) + 1
    assert got[0]["new_ids"] == want[0][:cut] and got[0]["finish_reason"] == "stop"
    assert got[1]["new_ids"] == want[1][:5] and got[1]["finish_reason"] == "length"
    assert got[1]["text"].split() == [WORDS[i] for i in want[1][:5]] and got[1]["ids"] == PROMPTS[1]
    assert got[2]["new_ids"] == want[2] and "text" not in got[2] and got[2]["ids"] == PROMPTS[2]
    assert set(got[0]) == {"index", "ids", "new_ids", "finish_reason"}
    # each sequence's line is on disk as soon as the model says it is done, the run still going
    assert {i for i, _ in seen} == {0, 1, 2}
    assert all(i in on_disk for i, on_disk in seen)
    assert any(len(on_disk) < 3 for _, on_disk in seen)
    stats = json.loads(err.strip().splitlines()[-1])
    assert stats["sequences"] == 3 and stats["batch"] == 2 and len(stats["batches"]) == 2
    assert {"prefill_s", "new_tokens_per_s", "step_ms", "bytes_loaded_per_step", "micro"} <= set(stats)
    assert [b["first"] for b in stats["batches"]] == [0, 2]
    assert stats["new_tokens"] == sum(b["new_tokens"] for b in stats["batches"])
    # line 0 ended at its own stop id in the model: no token decoded past it
    assert stats["new_tokens"] == sum(len(d["new_ids"]) for d in got.values())
    assert stats["decode_steps"] == sum(b["decode_steps"] for b in stats["batches"]) > 0
    assert stats["step_ms"] > 0 and stats["bytes_loaded_per_step"] >= 0 and stats["micro"] == [1]


def test_results_go_to_stdout_and_statistics_to_a_file(ckpt, want, tmp_path, capsys):
    prompts = jsonl(tmp_path / "p.jsonl", *({"ids": ids} for ids in PROMPTS))
    stats = tmp_path / "stats.json"
    args = ["--prompts", prompts, "--batch", "3", "--max-new-tokens", "4", "--ignore-eos", *RUN]
    code, stdout, err = run(capsys, ckpt[0], *args, "--stats", stats, "--progress")
    assert code == 0, err
    got = sorted(lines_of(stdout), key=lambda d: d["index"])
    assert [d["new_ids"] for d in got] == [w[:4] for w in want]
    doc = json.loads(stats.read_text())
    assert doc["sequences"] == 3 and doc["new_tokens"] == 12 and doc["batches"][0]["first"] == 0
    assert "3/3" in err and "new tokens/s" in err  # the progress bar, asked for off a terminal


def test_a_failed_run_keeps_only_the_whole_lines_of_the_sequences_done(ckpt, tmp_path, capsys, monkeypatch):
    prompts = jsonl(tmp_path / "p.jsonl", *({"ids": ids} for ids in PROMPTS))
    out = tmp_path / "out.jsonl"
    real = LlamaModel.run_generate_batch
    calls, fail_at = [], [2]

    def failing(self, *a, **kw):
        calls.append(1)
        if len(calls) == fail_at[0]:
            raise RunError("worker 0 died")
        return real(self, *a, **kw)

    monkeypatch.setattr(LlamaModel, "run_generate_batch", failing)
    args = ["--prompts", prompts, "--batch", "2", "--max-new-tokens", "3", *RUN, "--out", out]
    code, stdout, err = run(capsys, ckpt[0], *args)
    assert code == 2 and "worker 0 died" in err and "2 finished sequences are in" in err, err
    assert len(err.splitlines()) == 1 and stdout == ""
    assert not out.exists()
    text = Path(f"{out}.partial").read_text()
    assert text.endswith("\n") and sorted(d["index"] for d in lines_of(text)) == [0, 1]
    # a run that fails before any sequence is done leaves nothing at all
    Path(f"{out}.partial").unlink()
    calls.clear()
    fail_at[0] = 1
    code, _, err = run(capsys, ckpt[0], *args)
    assert code == 2 and "worker 0 died" in err and "finished sequences" not in err
    assert not out.exists() and not Path(f"{out}.partial").exists()


def test_the_disco_ray_process_writes_the_jsonl_on_stdout_and_refuses_a_bad_line(ckpt, want, tmp_path):
    prompts = jsonl(tmp_path / "p.jsonl", {"ids": PROMPTS[0]}, {"ids": PROMPTS[2]})
    args = ["--batch", "2", "--max-new-tokens", "3", "--ignore-eos", *RUN]
    r = run_cli("generate", ckpt[0], "--prompts", prompts, *args)
    assert r.returncode == 0, r.stderr
    got = sorted(lines_of(r.stdout), key=lambda d: d["index"])
    assert [d["new_ids"] for d in got] == [want[0][:3], want[2][:3]]
    assert "seq/s" not in r.stderr  # no bar: stderr is no terminal and --progress was not given
    bad = jsonl(tmp_path / "bad.jsonl", {"ids": [1]}, '{"ids": [1,')
    r = run_cli("generate", ckpt[0], "--prompts", bad, *args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"disco-ray: error: {bad}:2: malformed JSON at column 12: Expecting value"
    ]


# ---- sampling and stop ids ---------------------------------------------------------------------------
def test_sampling_with_a_seed_repeats_and_one_prompt_takes_stop_ids(ckpt, want, tmp_path, capsys):
    prompts = jsonl(tmp_path / "p.jsonl", *({"ids": ids} for ids in PROMPTS))
    args = ["--prompts", prompts, "--batch", "2", "--max-new-tokens", "6", "--ignore-eos", *RUN]
    sampled = ["--temperature", "1.5", "--top-k", "20", "--top-p", "0.95", "--seed", "7"]
    runs = []
    for _ in range(2):
        code, stdout, err = run(capsys, ckpt[0], *args, *sampled)
        assert code == 0, err
        runs.append(sorted(lines_of(stdout), key=lambda d: d["index"]))
    assert runs[0] == runs[1]
    assert [d["new_ids"] for d in runs[0]] != [w[:6] for w in want]  # it sampled: not greedy
    code, stdout, _ = run(capsys, ckpt[0], *args, *sampled, "--greedy")
    assert [d["new_ids"] for d in sorted(lines_of(stdout), key=lambda d: d["index"])] == [w[:6] for w in want]
    stop = want[2][2]
    ids = ",".join(map(str, PROMPTS[2]))
    code, stdout, err = run(
        capsys, ckpt[0], "--prompt-ids", ids, "--max-new-tokens", "8", "--stop-ids", stop, *RUN
    )
    assert code == 0, err
    assert stdout.strip() == ",".join(map(str, want[2][: want[2].index(stop) + 1]))
    assert "stopped: stop" in err


def test_a_lines_sampled_tokens_do_not_depend_on_batch(ckpt, want, tmp_path, capsys):
    lines = [
        {"ids": PROMPTS[0]},
        {"ids": PROMPTS[1], "max_new_tokens": 3},
        {"ids": PROMPTS[2], "stop_ids": [want[2][1]]},  # may stop early if sampled: frees its row
        {"ids": PROMPTS[0][::-1]},
        {"ids": PROMPTS[2][:3], "max_new_tokens": 5},
    ]
    prompts = jsonl(tmp_path / "p.jsonl", *lines)
    args = ["--prompts", prompts, "--max-new-tokens", "6", "--ignore-eos", *RUN]
    sampled = ["--temperature", "1.5", "--seed", "11"]
    runs = {}
    for batch in (1, 2, 4):
        code, stdout, err = run(capsys, ckpt[0], *args, *sampled, "--batch", batch)
        assert code == 0, err
        runs[batch] = sorted(lines_of(stdout), key=lambda d: d["index"])
    assert runs[1] == runs[2] == runs[4]
    assert len({tuple(d["new_ids"]) for d in runs[1]}) == 5  # each line its own stream
    # line 0 of a file samples as the same prompt given alone
    ids = ",".join(map(str, PROMPTS[0]))
    code, stdout, err = run(
        capsys, ckpt[0], "--prompt-ids", ids, "--max-new-tokens", "6", "--ignore-eos", *RUN, *sampled
    )
    assert code == 0 and stdout.strip() == ",".join(map(str, runs[1][0]["new_ids"])), err


# ---- the pure parts ------------------------------------------------------------------------------------
def test_results_make_a_line_per_finished_sequence_once():
    batch = [Request(10, 1, (1, 2), 5, stop_ids=(7,)), Request(11, 2, (3,), 5, text=True)]
    r = Results(batch, decode=lambda ids: " ".join(WORDS[i] for i in ids))
    assert r.finish(0, [4, 7], "stop") == {
        "index": 10,
        "ids": [1, 2],
        "new_ids": [4, 7],
        "finish_reason": "stop",
    }
    assert r.finish(0, [4, 7], "stop") is None and not r.all_done()  # reported once
    doc = r.finish(1, [7, 3], "length")
    assert doc == {"index": 11, "ids": [3], "new_ids": [7, 3], "text": "w7 w3", "finish_reason": "length"}
    assert r.all_done()


def test_the_sink_renames_only_when_committed(tmp_path):
    out = tmp_path / "r.jsonl"
    with LineSink(str(out)) as sink:
        sink.write({"index": 0})
        assert Path(f"{out}.partial").read_text() == '{"index": 0}\n' and not out.exists()
        sink.commit()
    assert out.read_text() == '{"index": 0}\n' and not Path(f"{out}.partial").exists()
    with LineSink(str(out)) as sink:  # nothing written, not committed: nothing left
        pass
    assert not Path(f"{out}.partial").exists() and out.read_text() == '{"index": 0}\n'
