"""benchmarks/gpu_session.sh, without a GPU: it parses, every part fits a device call by
construction (its own `timeout`), and every python command a part runs takes the flags it is given
(the CLI's own parser; a benchmark's --help; pytest's files and markers)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
CALL_S = 8 * 60  # the most one part may take (the device tool's call: 10 minutes)


def _bash(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _parts() -> list[str]:
    m = re.search(r'^PARTS="([^"]+)"', SCRIPT.read_text(), re.M)
    assert m, "gpu_session.sh names its parts in PARTS"
    return m.group(1).split()


def test_it_parses_and_each_part_is_bounded_by_construction():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text()
    m = re.search(r"^PART_S=\$\{PART_S:-(\d+)\}", text, re.M)
    assert m and int(m.group(1)) <= CALL_S, "a part's default bound must fit one device call"
    assert re.search(r'timeout [^\n]*"\$PART_S" bash "\$0" _part', text), "every part runs under its timeout"
    parts = set(_parts())
    assert {"decode", "lora", "disk", "host", "racecheck", "tests"} <= parts, parts


def test_a_part_past_its_bound_is_stopped(tmp_path):
    """A python3 that never returns: the part ends at PART_S, with a line saying so
    (planted: without the timeout wrapper the call runs until the test's own limit)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\nexec sleep 300\n")
    (fake / "python3").chmod(0o755)
    t0 = time.monotonic()
    got = _bash("host", str(tmp_path / "out"), env={"PART_S": "2", "PATH": f"{fake}:{os.environ['PATH']}"})
    assert got.returncode in (124, 137), (got.returncode, got.stderr)
    assert "ran past its 2 s" in got.stderr, got.stderr
    assert time.monotonic() - t0 < 30


def _commands(part: str, out: Path) -> list[list[str]]:
    got = _bash(part, str(out), env={"DRY": "1"})
    assert got.returncode == 0, (part, got.stderr)
    cmds = [shlex.split(line) for line in got.stdout.splitlines() if line.strip()]
    assert cmds, f"part {part} runs nothing"
    for c in cmds:
        if c[0] == "compute-sanitizer":  # the python command it runs
            del c[: c.index("python3")]
        assert c[0] == "python3", f"part {part}: {c}"
    return [c[1:] for c in cmds]


def _check_pytest(args: list[str], markers: set[str]) -> None:
    k = 0
    while k < len(args):
        a = args[k]
        if a == "-m":
            words = set(re.findall(r"[A-Za-z_]+", args[k + 1])) - {"and", "or", "not"}
            assert words <= markers, f"unregistered markers {words - markers}"
            k += 1
        elif a.startswith("--timeout"):
            pytest.importorskip("pytest_timeout")
        elif not a.startswith("-"):
            assert (ROOT / a).is_file(), f"no test file {a}"
        k += 1


def _check_benchmark(script: str, args: list[str]) -> None:
    path = Path(script)
    assert path.is_file(), f"no benchmark {script}"
    got = subprocess.run(
        [sys.executable, str(path), "--help"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, (script, got.stderr[-2000:])
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", got.stdout), f"{path.name} takes no {flag}"


def test_every_python_command_of_every_part_takes_its_flags(tmp_path):
    from disco_ray.cli.app import build_parser

    markers = set(re.findall(r'^\s*"(\w+):', (ROOT / "pyproject.toml").read_text(), re.M))
    parser = build_parser()
    scripts: dict[str, set[str]] = {}
    for part in _parts():
        for c in _commands(part, tmp_path):
            if c[:2] == ["-m", "pytest"]:
                _check_pytest(c[2:], markers)
            elif c[:2] == ["-m", "disco_ray"]:
                parser.parse_args(c[2:])  # UsageError (the CLI's one line) if a flag is wrong
            elif c[0] == "-c":
                compile(c[1], f"<{part}: python3 -c>", "exec")
            else:
                scripts.setdefault(c[0], set()).update(c[1:])
    assert scripts, "no benchmark script called"
    for script, args in scripts.items():
        _check_benchmark(script, sorted(args))
