"""Docs that run (issue #30, item 9): every fenced block of README.md and docs/*.md whose fence
says `run` runs here, so a command or snippet the docs show cannot drift from the code.

A block is tagged by the word `run` after its language (GitHub highlights by the first word only):

    ```bash run            a shell block: each line must exit 0 (bash -e -o pipefail)
    ```python run          a Python block: it must not raise
    ```bash run timeout=120  its time limit in seconds (default 180)

Tag only blocks that need no GPU, no cluster and no network, and take seconds. The blocks of one
document run in its order (tests/docs_runner.py), in a temporary directory of its own with the
repository on PYTHONPATH, the test's `python` and a `disco-ray` command on PATH, and what the docs'
placeholders name: `examples/` (the repository's), `ckpt/`, `CKPT_DIR` and `CKPT` (one tiny random
LLaMA checkpoint with a 32000-token vocabulary, made once per test session), `prompts.jsonl` and
`in.jsonl` (two prompts), `tokens.npy` (int64 [4, 16] token ids). A path under `/tmp/` in a block
is that directory's `tmp/`. Python blocks of one document share one interpreter: a later block uses
an earlier one's names. A block that fails fails the test with its file and line. Every block of
every document joins one Ray started here (`DISCO_RAY_ADDRESS`, as a user's `ray start` would be
joined) instead of each command starting and stopping a private one (docs/BENCHMARKS.md#start-up).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from tests.ray_fixtures import joining, ray_address  # noqa: F401  (module fixture: the Ray the blocks join)

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)(.*)$")
LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
TIMEOUT_S = 180  # a hang's bound, not a speed check: a loaded CI box starts Ray slowly
CKPT_NAMES = ("ckpt", "CKPT_DIR", "CKPT")  # what the docs call a checkpoint directory


@dataclass(frozen=True, slots=True)
class Block:
    doc: str  # relative to the repository
    line: int  # of the opening fence
    lang: str  # "bash" or "python"
    code: str
    timeout: int  # seconds


def tagged(doc: Path) -> list[Block]:
    """The blocks of `doc` tagged to run, in order; a fence whose words after the language are
    not `run [timeout=S]` but say `run` is an error (a typo would silently skip the block)."""
    name = doc.relative_to(ROOT).as_posix() if doc.is_relative_to(ROOT) else doc.name
    lines = doc.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        words = m.group(2).split()
        if "run" in words:
            timeout = [w for w in words if w.startswith("timeout=")]
            if words[0] != "run" or len(words) > 1 + len(timeout) or m.group(1) not in LANGS:
                raise ValueError(f"{name}:{i + 1}: a run tag is ```bash run [timeout=S] or ```python run")
            seconds = int(timeout[0].split("=", 1)[1]) if timeout else TIMEOUT_S
            out.append(Block(name, i + 1, LANGS[m.group(1)], "\n".join(lines[i + 1 : end]) + "\n", seconds))
        i = end + 1
    return out


@pytest.fixture(scope="session")
def placeholders(tmp_path_factory) -> Path:
    """The files the docs' placeholders name, made once (the checkpoint only when a block uses one)."""
    import numpy as np

    d = tmp_path_factory.mktemp("doc_files")
    np.save(d / "tokens.npy", np.random.default_rng(0).integers(0, 32000, (4, 16), dtype=np.int64))
    prompts = '{"ids": [1, 306, 4658]}\n{"ids": [1, 20, 30, 40, 50], "max_new_tokens": 4}\n'
    for name in ("prompts.jsonl", "in.jsonl"):
        (d / name).write_text(prompts)
    codes = [b.code for doc in DOCS for b in tagged(doc)]
    if any(n in code for code in codes for n in CKPT_NAMES):
        pytest.importorskip("transformers")
        from tests.test_models import make_checkpoint

        make_checkpoint(
            d / "ckpt", seed=0, vocab_size=32000, num_key_value_heads=2, max_position_embeddings=256
        )
    return d


def workdir(base: Path, files: Path | None = None) -> Path:
    """A fresh directory holding the placeholders (links to `files`), `examples/`, `tmp/` and a
    `disco-ray` command."""
    base.mkdir()
    for f in files.iterdir() if files is not None else ():
        (base / f.name).symlink_to(f)
    if files is not None and (files / "ckpt").exists():
        for name in CKPT_NAMES[1:]:
            (base / name).symlink_to(files / "ckpt")
    (base / "examples").symlink_to(ROOT / "examples")
    (base / "tmp").mkdir()
    (base / ".bin").mkdir()
    shim = base / ".bin" / "disco-ray"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m disco_ray "$@"\n')
    shim.chmod(0o755)
    return base


def run_blocks(blocks: list[Block], where: Path, address: str | None = None) -> subprocess.CompletedProcess:
    """Runs `blocks` in order in `where` (made by `workdir`): tests/docs_runner.py's result. With
    `address`, their Ray runs join the Ray there instead of each starting a private one."""
    local = [asdict(b) | {"code": b.code.replace("/tmp/", f"{where}/tmp/")} for b in blocks]
    (where / ".blocks.json").write_text(json.dumps(local))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(where / ".bin"), str(Path(sys.executable).parent), os.environ["PATH"]]),
        "MPLBACKEND": "Agg",
    }
    if address is not None:
        env |= joining(address)
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "docs_runner.py"), str(where / ".blocks.json")],
        cwd=where,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=sum(b.timeout for b in blocks) + 60,
    )


def failure(done: subprocess.CompletedProcess) -> str:
    """The runner's "FAILED doc:line: why" first, then the tail of what the blocks printed."""
    last = [ln for ln in done.stdout.splitlines() if ln.startswith("FAILED ")]
    head = last[-1] if last else f"the runner exited {done.returncode}"
    return head + "\n" + "\n".join(done.stdout.splitlines()[-40:])


RUNNABLE = [doc for doc in DOCS if tagged(doc)]


@pytest.mark.slow
@pytest.mark.parametrize("doc", RUNNABLE, ids=[d.name for d in RUNNABLE])
def test_the_tagged_blocks_of_the_docs_run(doc, placeholders, ray_address, tmp_path):  # noqa: F811
    done = run_blocks(tagged(doc), workdir(tmp_path / "run", placeholders), ray_address)
    assert done.returncode == 0, failure(done)


def test_a_failing_block_is_named_by_its_file_and_line(tmp_path):
    doc = tmp_path / "BROKEN.md"
    doc.write_text(
        "# Doc\n\n```bash run\necho ok > /tmp/ok.txt\ncat /tmp/ok.txt\n```\n\n"
        "```python run\nx = 1\n```\n\n```\nnot tagged: never runs\n```\n\n"
        "```python run timeout=5\nassert x == 1\nopen('nowhere/file')\n```\n"
    )
    blocks = tagged(doc)
    assert [(b.line, b.lang, b.timeout) for b in blocks] == [
        (3, "bash", 180),
        (8, "python", 180),
        (16, "python", 5),
    ]
    done = run_blocks(blocks, workdir(tmp_path / "run"))
    assert done.returncode == 1
    assert failure(done).startswith("FAILED BROKEN.md:16: FileNotFoundError"), failure(done)
    assert 'File "BROKEN.md", line 18' in done.stdout  # the traceback points into the document
    assert (tmp_path / "run" / "tmp" / "ok.txt").read_text() == "ok\n"  # /tmp/ is the run's own


def test_a_shell_block_fails_on_its_first_failing_line_and_a_slow_one_on_its_time(tmp_path):
    doc = tmp_path / "SHELL.md"
    doc.write_text("```bash run\ndisco-ray plan nowhere.json --capacity 1KiB -o x.json\necho after\n```\n")
    done = run_blocks(tagged(doc), workdir(tmp_path / "a"))
    assert failure(done).startswith("FAILED SHELL.md:1: exit status 2 at line 2: disco-ray plan"), failure(
        done
    )
    assert "after" not in done.stdout
    doc.write_text("```sh run timeout=1\nsleep 5\n```\n")
    done = run_blocks(tagged(doc), workdir(tmp_path / "b"))
    assert failure(done).startswith("FAILED SHELL.md:1: ran past 1 s"), failure(done)


def test_a_misspelt_run_tag_is_an_error(tmp_path):
    doc = tmp_path / "TYPO.md"
    doc.write_text("```bash run timout=5\ntrue\n```\n")
    with pytest.raises(ValueError, match=r"TYPO.md:1: a run tag is"):
        tagged(doc)
