"""Issue 30, "a bad budget mid-run": the corpus of tests/test_reliability.py grows by the budget
files that ended a generation. A `--budget-file` that becomes garbage, is deleted, holds non-UTF-8
bytes or gives the wrong number of sizes keeps the last good budget with one warning per distinct
bad content naming the file and the value; one above the device's memory is clamped to it with a
warning. The generation goes on, its tokens those of a run left alone. At start, a bad file is
still one error line, exit 2.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

import workloads
from disco_ray.cli import main
from disco_ray.driver.elastic import BudgetFile, fit_budget
from disco_ray.graph.errors import UsageError
from disco_ray.models import LlamaModel

pytest.importorskip("transformers")
from tests.test_models import make_checkpoint

PROMPT = [5, 17, 3]
MiB = 1 << 20
# what a budget file goes through while a generation runs: poll number -> its new content
# (None: deleted); each bad content is warned about once, however many polls see it
SCRIPT = {
    2: b"garbage",
    3: b"garbage",  # rewritten the same: no second warning
    4: None,
    6: b"\xff\xfe1MiB",
    8: b"2MiB",
    9: b"",
    10: b"1MiB,2MiB",
}
WARNED = ["bad size 'garbage'", "cannot read (No such file or directory)", "not UTF-8 text", "empty"]
WARNED.append("gives 2 sizes for 1 GPU(s)")


def rewrite(path: Path, content: bytes | None) -> None:
    """`path` holds `content` (None: deleted), with a later modification time whatever the clock."""
    if content is None:
        path.unlink()
        return
    before = path.stat().st_mtime_ns if path.exists() else time.time_ns()
    path.write_bytes(content)
    os.utime(path, ns=(before + 10**9, before + 10**9))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("budget")
    make_checkpoint(path)
    return str(path)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---- the pure parts ----------------------------------------------------------------------------
def test_a_bad_budget_file_keeps_the_last_good_budget_and_warns_once_per_content(tmp_path, caplog):
    path = tmp_path / "budget"
    path.write_text("1MiB")
    b = BudgetFile(str(path))
    seq = b.budget.seq
    caplog.set_level(logging.WARNING, logger="disco_ray")
    for poll in range(1, 12):
        if poll in SCRIPT:
            rewrite(path, SCRIPT[poll])
        got = b.poll()
        assert got.capacity == (2 * MiB if 8 <= poll < 10 else 1 * MiB if poll < 8 else [MiB, 2 * MiB])
    warned = _warnings(caplog)
    assert len(warned) == 4, warned  # the count mismatch is the model's to refuse (fit_budget)
    assert all(w.startswith(f"--budget-file {path}: ") for w in warned)
    for w, frag in zip(warned, WARNED, strict=False):
        assert frag in w, (w, frag)
    assert "keeping the last good budget 1 MiB" in warned[0] and "b'\\xff\\xfe1MiB'" in warned[2]
    assert b.budget.seq == seq + 2  # 2MiB, then 1MiB,2MiB
    rewrite(path, b"garbage")  # bad again after a good one: a new warning
    b.poll()
    assert len(_warnings(caplog)) == 5 and "keeping the last good budget 1 MiB,2 MiB" in _warnings(caplog)[-1]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"\xff\xfe", "not UTF-8 text (byte 0"),
        (b"lots", "bad size 'lots'"),
        (b"  \n", "empty"),
        (None, "cannot read"),
    ],
)
def test_a_bad_budget_file_at_start_is_one_usage_error(tmp_path, content, fragment):
    path = tmp_path / "budget"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=f"--budget-file {path}: {fragment}".replace("(", r"\(")):
        BudgetFile(str(path))


def test_fit_budget_clamps_to_the_device_and_refuses_a_wrong_count(caplog):
    caplog.set_level(logging.WARNING, logger="disco_ray")
    assert fit_budget(3 * MiB, 2, 4 * MiB, "f") == 3 * MiB and fit_budget([MiB, 9 * MiB], 2, None, "f") == [
        MiB,
        9 * MiB,
    ]
    assert _warnings(caplog) == []
    assert fit_budget(100 << 30, 2, 4 * MiB, "f") == 4 * MiB
    assert fit_budget([MiB, 100 << 30], 2, 4 * MiB, "f") == [MiB, 4 * MiB]
    assert fit_budget([MiB, MiB, MiB], 2, None, "f") is None
    w = _warnings(caplog)
    assert len(w) == 3 and w[0] == "f: 100 GiB is above the device's memory (4 MiB per GPU); clamped to it"
    assert "gives 3 sizes for 2 GPU(s); keeping the current capacity" in w[2]


# ---- a generation goes on --------------------------------------------------------------------------
def test_a_generation_follows_a_budget_file_that_goes_bad(ckpt, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(workloads, "available_memory", lambda: 3 * MiB)  # the device: 3 MiB
    path = tmp_path / "budget"
    path.write_text("1MiB")
    script = {**SCRIPT, 12: b"64GiB"}
    with LlamaModel(ckpt, capacity="1MiB", engine="local", block=4) as m:
        want = m.generate(PROMPT, 16, stop_at_eos=False)
        m.watch(BudgetFile(str(path)))
        caplog.set_level(logging.WARNING, logger="disco_ray")
        polls: list[int] = []
        poll = m._poll_budget

        def scripted() -> None:
            polls.append(1)
            if len(polls) in script:
                rewrite(path, script[len(polls)])
            poll()

        monkeypatch.setattr(m, "_poll_budget", scripted)
        gen = m.run_generate(PROMPT, 16, stop_at_eos=False)
    assert gen.tokens == want and len(polls) == 15
    assert [r["capacity"] for r in m.resizes] == [[2 * MiB], [3 * MiB]]  # 2MiB, then 64GiB clamped
    warned = _warnings(caplog)
    assert len(warned) == 6, warned
    for w, frag in zip(warned, [*WARNED, "64 GiB is above the device's memory (3 MiB per GPU)"], strict=True):
        assert frag in w and str(path) in w, (w, frag)


def test_the_cli_warns_once_per_bad_content_and_keeps_every_token(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(workloads, "available_memory", lambda: 3 * MiB)
    path = tmp_path / "budget"
    path.write_text("1MiB")
    argv = ["generate", ckpt, "--prompt-ids", "5,17,3", "--max-new-tokens", "16", "--engine", "local",
            "--block", "4", "--ignore-eos", "--json"]  # fmt: skip
    assert main([*argv, "--capacity", "1MiB"]) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    polls: list[int] = []
    poll = LlamaModel._poll_budget

    def scripted(self) -> None:
        polls.append(1)
        if len(polls) in SCRIPT:
            rewrite(path, SCRIPT[len(polls)])
        poll(self)

    monkeypatch.setattr(LlamaModel, "_poll_budget", scripted)
    assert main([*argv, "--budget-file", str(path)]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["tokens"] == want and [r["capacity"] for r in doc["resizes"]] == [[2 * MiB]]
    lines = err.splitlines()
    assert len(lines) == 5 and all(ln.startswith(f"warning: --budget-file {path}: ") for ln in lines), err
    for ln, frag in zip(lines, WARNED, strict=True):
        assert frag in ln, (ln, frag)


def test_a_budget_above_the_device_at_start_is_clamped(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(workloads, "available_memory", lambda: 3 * MiB)
    path = tmp_path / "budget"
    path.write_text("100GiB")
    argv = ["generate", ckpt, "--prompt-ids", "5,17,3", "--max-new-tokens", "4", "--engine", "local",
            "--block", "4", "--json", "--budget-file", str(path)]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["plans"][0]["capacity"] == [3 * MiB]
    assert (
        err
        == f"warning: --budget-file {path}: 100 GiB is above the device's memory (3 MiB per GPU); clamped to it\n"
    )
    path.write_bytes(b"\xff\xfe")
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err == f"disco-ray: error: --budget-file {path}: not UTF-8 text (byte 0 of b'\\xff\\xfe')\n"
    )
