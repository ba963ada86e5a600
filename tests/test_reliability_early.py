"""Issue 30, "fail before the work": the corpus of tests/test_reliability.py grows by the cases that
failed late and lost the work.

- An output that cannot be written is refused at argument time, by every command that writes:
  one line naming the option and the path, exit 2, nothing written. The other arguments of each
  case are bogus (no model, no data): an error about the output proves it was checked first.
- `--max-new-tokens` beyond `max_position_embeddings`, or whose last decode step does not fit the
  capacity, is refused before the first token (that step is planned first).
- The one prompt's tokens are streamed as made, so a run that fails late keeps them on stdout
  (`--json`: one object with "finish_reason": "error").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from disco_ray.cli import main
from disco_ray.driver.program import Program
from disco_ray.graph.errors import CapacityError, RunError, UsageError
from disco_ray.graph.sizes import format_size
from disco_ray.models import LlamaModel
from disco_ray.models.graphs import capacity_bounds
from disco_ray.models.planned import last_steps
from tests.test_reliability import CHAIN, Case, _unwritable, assert_refused

pytest.importorskip("transformers")
from tests.test_models import make_checkpoint

PROMPT = [5, 17, 3]
RUN = ["--engine", "local", "--block", "4", "--ignore-eos"]


# ---- outputs checked at argument time -----------------------------------------------------------
def _gen(*extra: str):
    """`generate` of a model that does not exist: only the argument checks can answer."""
    return lambda d: ["generate", str(d / "no-model"), "--prompt-ids", "1", "--max-new-tokens", "1",
                      "--capacity", "1MiB", *(e.replace("{dir}", str(d)) for e in extra)]  # fmt: skip


def _with_ro(argv: list[str]):
    """`argv` with "{ro}" a place under a file, where nothing can be made."""
    return lambda d: [a.replace("{ro}", str(_unwritable(d))).replace("{dir}", str(d)) for a in argv]


def _a_dir(name: str, argv: list[str]):
    """`argv` with "{out}" a directory named `name` (made here): an output file cannot be it."""

    def make(d: Path) -> list[str]:
        (d / name).mkdir()
        return [a.replace("{out}", str(d / name)).replace("{dir}", str(d)) for a in argv]

    return make


FINETUNE = "finetune {dir}/no-model --data x.npy --steps 1 --lr 1 --capacity 1MiB --out"
EARLY_CASES = [
    Case("generate-logits-is-a-dir", _gen("--logits", "{dir}"), ("--logits {dir}:", "Is a directory"), ()),
    Case("generate-logits-under-a-file", _gen("--logits", "{dir}/ro/l.npz"), ("--logits", "ro/l.npz"), ()),
    Case("generate-out-missing-dir", _gen("--out", "{dir}/no/o.jsonl"), ("--out", "no/o.jsonl"), ()),
    Case("generate-stats-is-a-dir", _gen("--stats", "{dir}"), ("--stats {dir}:",), ()),
    Case(
        "finetune-out-under-a-file",
        _with_ro(f"{FINETUNE} {{ro}}/adapter".split()),
        ("--out", "ro/adapter", "Not a directory"),
        (),
    ),
    Case(
        "finetune-out-is-a-file",
        _with_ro(f"{FINETUNE} {{ro}}".split()),
        ("--out {dir}/ro:",),
        (),
    ),
    Case(
        "run-out-is-a-dir",
        _a_dir("o.npz", ["run", "{dir}/nope.json", "--out", "{out}", "--engine", "local"]),
        ("--out", "o.npz", "Is a directory"),
        (),
    ),
    Case(
        "run-trace-is-a-dir",
        _a_dir("t.json", ["run", "{dir}/nope.json", "--out", "{dir}/o.npz", "--trace", "{out}"]),
        ("--trace", "t.json"),
    ),
    Case(
        "plan-output-is-a-dir",
        _a_dir("m.json", ["plan", "{dir}/nope.json", "--capacity", "1MiB", "-o", "{out}"]),
        ("m.json", "Is a directory"),
        (),
    ),
    Case(
        "workload-inputs-under-a-file",
        _with_ro(["workload", "matmul_chain", "-o", "{dir}/g.json", "--inputs", "{ro}/in.npz"]),
        ("--inputs", "ro/in.npz"),
        ("g.json",),
    ),
    Case("bench-out-under-a-file", _with_ro(["bench", str(CHAIN), "--out", "{ro}/b"]), ("--out", "ro/b"), ()),
    Case("demo-out-under-a-file", _with_ro(["demo", "--out", "{ro}/o"]), ("--out", "ro/o"), ()),
    Case("plot-o-is-a-dir", _a_dir("t.png", ["plot", "{dir}/nope.json", "-o", "{out}"]), ("-o", "t.png"), ()),
]


@pytest.mark.parametrize("case", EARLY_CASES, ids=[c.id for c in EARLY_CASES])
def test_an_output_that_cannot_be_written_is_refused_before_anything(case, tmp_path, capsys):
    argv = case.make(tmp_path)
    capsys.readouterr()
    rc = main(argv)
    captured = capsys.readouterr()
    line = assert_refused(rc, captured.err, tmp_path, case)
    assert "cannot write" in line and captured.out == "", (case.id, line)


def test_an_output_case_as_a_user_runs_it(tmp_path):
    from tests.conftest import run_cli

    case = EARLY_CASES[0]
    r = run_cli(*case.make(tmp_path))
    assert_refused(r.returncode, r.stderr, tmp_path, case)


# ---- --max-new-tokens checked before the first token -------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A tiny checkpoint: 128 positions, prefill at 35 KiB, the 120th new token's step at 63 KiB."""
    path = tmp_path_factory.mktemp("early")
    make_checkpoint(path)
    return str(path)


def test_last_steps_names_the_last_step_of_each_row_count():
    # maxes 9, 5, 2, 2 from cache index 8 (block 4): 4 rows to step 1, 2 rows to step 4, 1 row to
    # step 8 (cache index 15: block 4); 9, 5, 5, 2 keeps 4 rows (3 live) to step 4
    assert last_steps(8, [9, 5, 2, 2], 4) == [(1, 4), (2, 3), (4, 3)]
    assert last_steps(8, [9, 5, 5, 2], 4) == [(1, 4), (4, 3)]
    assert last_steps(3, [1], 4) == [] and last_steps(3, [2], 4) == [(1, 1)]


def _gen_cli(ckpt: str, *extra) -> list[str]:
    return ["generate", ckpt, "--prompt-ids", ",".join(map(str, PROMPT)), *RUN, *map(str, extra)]


@pytest.mark.parametrize("json_out", [False, True])
def test_too_many_new_tokens_for_the_positions_are_refused_before_the_model_loads(
    ckpt, tmp_path, capsys, json_out
):
    argv = _gen_cli(ckpt, "--max-new-tokens", 126, "--capacity", "1MiB", *(["--json"] if json_out else []))
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert "--max-new-tokens 126: 3 prompt tokens + 126 new = 129 positions" in err
    assert "max_position_embeddings 128" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"ids": [1, 2]}\n{"ids": [1, 2, 3], "max_new_tokens": 126}\n')
    argv = ["generate", ckpt, "--prompts", prompts, "--capacity", "1MiB", "--engine", "local",
            "--max-new-tokens", "2", "--out", tmp_path / "o.jsonl"]  # fmt: skip
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}:2: 3 prompt tokens + 126 new = 129 positions" in err and err.count("\n") == 1
    assert not list(tmp_path.glob("o.jsonl*"))


def test_a_last_step_beyond_the_capacity_is_refused_before_the_first_token(ckpt, capsys):
    need = capacity_bounds(ckpt, prompt=len(PROMPT), new_tokens=120, block=4).min[0]
    assert main(_gen_cli(ckpt, "--max-new-tokens", 40, "--capacity", "40KiB")) == 0  # it fits 40 tokens
    capsys.readouterr()
    assert main(_gen_cli(ckpt, "--max-new-tokens", 120, "--capacity", "40KiB")) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"needs a capacity of at least {format_size(need)} per GPU, above 40 KiB" in err, err


@pytest.mark.parametrize("batch", [False, True])
def test_the_python_api_refuses_before_anything_runs(ckpt, monkeypatch, batch):
    runs: list[int] = []
    run = Program.run
    monkeypatch.setattr(Program, "run", lambda self, *a, **k: runs.append(1) or run(self, *a, **k))
    with LlamaModel(ckpt, capacity="40KiB", engine="local", block=4) as m:
        go = m.run_generate_batch if batch else m.run_generate
        prompt = [PROMPT, [1, 2]] if batch else PROMPT
        with pytest.raises(UsageError, match="max_position_embeddings 128"):
            go(prompt, 126, on_token=lambda *_: pytest.fail("a token was made"))
        with pytest.raises(CapacityError, match="needs a capacity of at least"):
            go(prompt, 120, on_token=lambda *_: pytest.fail("a token was made"))
        assert runs == []  # nothing ran: each was refused from its plans alone
        assert len(go(prompt, 40).sequences if batch else go(prompt, 40).tokens) == (2 if batch else 40)


# ---- tokens streamed, kept when the run fails ---------------------------------------------------
def _fail_at_run(monkeypatch, k: int) -> None:
    """The k-th call of Program.run or Program.run_steps (the prefill is the first; a sampled
    generation's decode steps run several per run_steps call) raises a RunError."""
    calls: list[int] = []

    def failing(real):
        def call(self, *a, **kw):
            calls.append(1)
            if len(calls) == k:
                raise RunError("worker 0 (gpu 0): died (planted)")
            return real(self, *a, **kw)

        return call

    monkeypatch.setattr(Program, "run", failing(Program.run))
    monkeypatch.setattr(Program, "run_steps", failing(Program.run_steps))


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("json_out", [False, True])
def test_a_late_failure_keeps_the_tokens_made(ckpt, capsys, monkeypatch, sampled, json_out):
    how = ["--do-sample", "--seed", "7"] if sampled else []
    argv = _gen_cli(ckpt, "--max-new-tokens", 12, "--capacity", "1MiB", *how, "--json")
    assert main(argv) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    # greedy: the prefill and 4 one-step decode runs made 5 tokens; sampled: the prefill's token
    # and those of one call of several steps
    _fail_at_run(monkeypatch, 3 if sampled else 6)
    rc = main(argv if json_out else argv[:-1])
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    made = re.search(r"the (\d+) new tokens made before it are on stdout", err)
    assert "died (planted)" in err and made is not None, err
    n = int(made.group(1))
    assert n == 5 if not sampled else 1 < n < 12, err
    if json_out:
        doc = json.loads(out)
        assert doc["tokens"] == want[:n] and doc["finish_reason"] == "error"
        assert "died (planted)" in doc["error"] and doc["prompt_tokens"] == 3
    else:
        assert out == ",".join(map(str, want[:n])) + "\n"
