"""Issue 30 item 3: nothing left behind on any exit path.

Spill files (the disk tier, `actors.tiers.spill`) are gone after a run that succeeds, fails, is
interrupted (SIGINT, SIGTERM), loses a worker (killed, stopped) or finds the disk full: a worker
removes its own file when its graph is unloaded, and the pool removes what a worker it killed
left (`actors.tiers.sweep`). Outputs appear whole or not at all (`disco_ray.graph.files`): a
failed write leaves the previous file, or nothing. The CLI cases run as a user runs them, in a
process of their own with TMPDIR pointed at the test's directory: with a private Ray where the
signal ends it too or the workers must see that TMPDIR, else joining the module's running Ray.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from actors.tiers.diskio import ALIGN
from actors.tiers.spill import SpillFile
from actors.tiers.sweep import TEMP_PREFIX, owner, remove_left, spill_name
from disco_ray.graph.errors import RunError
from tests.conftest import ROOT
from tests.ray_fixtures import joining, ray_address  # noqa: F401  (module fixture: a Ray to join)

LLAMA = ["preset=tiny", "layers=4", "seq=256", "tile=64"]  # spills with the tiers below
TIERS = ["--capacity", "200KiB", "--host-capacity", "16KiB"]


def _alloc(n: int, host: bool) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


@pytest.fixture
def tmpdir_of_run():
    """The TMPDIR of a CLI run: where its spill directories without --disk go (and its Ray's
    session files: short, as Ray's socket paths must be)."""
    d = Path(tempfile.mkdtemp(prefix="dr-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _env(tmpdir: Path, address: str | None = None) -> dict:
    """A CLI run's environment; with `address`, its runs join the Ray there (not a private one)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmpdir), **(joining(address) if address else {})}


def _spill_left(tmpdir: Path, *dirs: Path) -> list[str]:
    """Spill files in `dirs` and spill directories in the run's TMPDIR."""
    left = [str(p) for d in dirs if d.exists() for p in d.iterdir()]
    return left + [str(p) for p in tmpdir.glob(TEMP_PREFIX + "*")]


def _one_error(err: str) -> str:
    errors = [ln for ln in err.splitlines() if ln.startswith("disco-ray: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


# ---- the names the sweep goes by ------------------------------------------------------------------
def test_a_spill_files_name_carries_its_process_and_only_those_are_removed(tmp_path):
    mine, other = spill_name(0, 4242), spill_name(1, 77)
    assert owner(mine) == 4242 and owner(other) == 77
    assert owner("spill-gpu0-x-1.bin") is None and owner("results.json") is None
    for name in (mine, other, "spill-gpu0-4242.txt", "notes.bin"):
        (tmp_path / name).write_bytes(b"x")
    assert remove_left(str(tmp_path), [4242]) == [str(tmp_path / mine)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other, "spill-gpu0-4242.txt", "notes.bin"])


def test_without_a_directory_the_sweep_removes_the_temporary_one_too(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    dead = tmp_path / f"{TEMP_PREFIX}abc"
    live = tmp_path / f"{TEMP_PREFIX}def"
    dead.mkdir(), live.mkdir()
    (dead / spill_name(0, 11)).write_bytes(b"x")
    (live / spill_name(1, 12)).write_bytes(b"x")
    assert len(remove_left(None, [11])) == 1
    assert not dead.exists() and len(list(live.iterdir())) == 1


# ---- a full disk ------------------------------------------------------------------------------------
def test_a_full_disk_when_the_spill_file_is_made_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(
        RunError, match=r"gpu:0: spill file .*/spill-gpu0-\d+-\w+\.bin: no room for its 8192 "
    ):
        SpillFile(str(tmp_path), 0, 2 * ALIGN, ALIGN, _alloc)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_spilling_ends_the_run_naming_the_file(tmp_path, monkeypatch):
    """ENOSPC in the writer thread: the run fails with one error naming the spill file and the
    cause; the Program's close removes the file."""
    from disco_ray.driver.api import compile
    from workloads import build

    w = build("llama_prefill", preset="tiny", layers=4, seq=256, tile=64)
    prog = compile(w.taskgraph, 200 << 10, host_capacity=0, engine="local", disk_dir=str(tmp_path), streams=2)
    real = os.pwritev

    def full(fd, buffers, offset, *a):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "pwritev", full)
    with (
        prog,
        pytest.raises(
            RunError, match=r"spill file .*spill-gpu\d-.*: a write failed: No space left on device"
        ),
    ):
        prog.run(w.inputs, timeout=120)
    assert list(tmp_path.iterdir()) == []


# ---- whole runs, as a user runs them -----------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("disk", [True, False], ids=["disk-dir", "tmpdir"])
def test_a_ray_run_that_spills_leaves_no_spill_file(tmp_path, tmpdir_of_run, disk, request):
    spill = tmp_path / "spill"
    args = ["run", "llama_prefill", *LLAMA, *TIERS, "--out", str(tmp_path / "o.npz"), "--check-reference"]
    args += ["--disk", str(spill)] if disk else []
    # without --disk the workers' TMPDIR is the run's: only a private Ray's workers inherit it
    address = request.getfixturevalue("ray_address") if disk else None
    r = subprocess.run(
        [sys.executable, "-m", "disco_ray", *args],
        capture_output=True,
        text=True,
        env=_env(tmpdir_of_run, address),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "disk bandwidth: write" in r.stderr and "outputs match" in r.stderr  # it did spill
    assert _spill_left(tmpdir_of_run, spill) == []


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.test_models import make_checkpoint

    path = tmp_path_factory.mktemp("ck")
    make_checkpoint(path, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=1024)
    return str(path)


def _wait_for_spill_file(proc, spill: Path, seconds: float = 180) -> int:
    """The pid of the first worker whose spill file appears (the run is then under way)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        pids = [owner(p.name) for p in spill.iterdir()] if spill.exists() else []
        if pids:
            return next(p for p in pids if p is not None)
        time.sleep(0.1)
    raise AssertionError(f"no spill file in {spill} (exit {proc.poll()}): {proc.stderr.read()[-3000:]}")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "rc", "word"),
    [
        (signal.SIGINT, 130, "interrupted"),
        (signal.SIGTERM, 143, "terminated"),
        (signal.SIGKILL, 2, "died"),  # to the worker
        (signal.SIGSTOP, 2, "has not answered"),  # to the worker: named after --stall-timeout
    ],
    ids=["sigint", "sigterm", "killed-worker", "stopped-worker"],
)
def test_generate_on_the_disk_tier_leaves_no_spill_file_after_a_fault(
    checkpoint, tmp_path, tmpdir_of_run, fault, rc, word, request
):
    spill = tmp_path / "spill"
    to_cli = fault in (signal.SIGINT, signal.SIGTERM)  # these end the CLI and the private Ray it made
    address = None if to_cli else request.getfixturevalue("ray_address")
    args = ["generate", checkpoint, "--prompt-ids", "5,17,3,99,42,7,8,1,60,63", "--max-new-tokens", "300"]
    # tight (the least for 300 tokens is 160512 bytes): from about the 45th decode step on, they spill
    args += ["--capacity", "175000", "--block", "4", "--ignore-eos"]
    args += ["--host-capacity", "0", "--disk", str(spill), "--stall-timeout", "3"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "disco_ray", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmpdir_of_run, address),
        start_new_session=True,  # its Ray's processes are found (and ended) by its session
        # Ctrl-C as at a terminal, even where this runs as a background job (which ignores SIGINT)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    worker = None
    try:
        worker = _wait_for_spill_file(proc, spill)
        time.sleep(0.5)  # into the decode steps
        os.kill(proc.pid if to_cli else worker, fault)
        err = proc.communicate(timeout=120)[1]
        assert proc.returncode == rc, err[-3000:]
        assert word in _one_error(err)
        assert _spill_left(tmpdir_of_run, spill) == []
    finally:
        if worker is not None and fault == signal.SIGSTOP:
            with contextlib.suppress(OSError):
                os.kill(worker, signal.SIGCONT)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of its session is left
        proc.wait(timeout=30)


# ---- outputs: whole or not at all -------------------------------------------------------------------
def test_an_output_that_fails_midway_leaves_the_previous_file_and_nothing_beside_it(tmp_path):
    from disco_ray.graph.files import new_directory, replacing, write_bytes

    out = tmp_path / "o.bin"
    write_bytes(out, b"old")
    with pytest.raises(OSError, match=r"No space left on device: '.*/o\.bin'"), replacing(out) as tmp:
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert out.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["o.bin"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # not the temporary file's 0600
    with pytest.raises(KeyboardInterrupt), new_directory(tmp_path / "adapter") as d:
        (d / "a.json").write_text("{}")
        raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["o.bin"]  # no directory, not even an empty one
    with new_directory(tmp_path / "adapter") as d:
        write_bytes(d / "a.json", b"{}")
    assert (tmp_path / "adapter" / "a.json").read_bytes() == b"{}"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.slow
def test_finetune_out_on_a_full_file_system_is_one_line_and_keeps_the_previous_adapter(tmp_path):
    """The adapter's files cannot be written (a file-size limit: EFBIG, as ENOSPC on a full disk
    fails a write): one error line naming the file, exit 2, no new directory (not even an empty
    one), and a previous adapter at --out is left as it was."""
    pytest.importorskip("transformers")
    import resource

    import numpy as np

    from tests.test_models import make_checkpoint

    make_checkpoint(tmp_path / "ck", seed=5, num_key_value_heads=2, tie_word_embeddings=False)
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 128, (2, 9)))
    args = ["finetune", str(tmp_path / "ck"), "--data", str(tmp_path / "tokens.npy"), "--steps", "1"]
    args += ["--lr", "0.01", "--capacity", "1MiB", "--block", "4", "--engine", "local", "--out"]

    def full() -> None:  # every file this run writes stops at 4 KiB (the adapter is larger)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    def finetune(out: Path, limit=None) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "disco_ray", *args, str(out)]
        env = _env(Path(tempfile.gettempdir()))
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, preexec_fn=limit)

    r = finetune(tmp_path / "new", full)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{tmp_path / 'new' / 'adapter_model.safetensors'}: File too large" in _one_error(r.stderr)
    assert not list(tmp_path.glob("*new*"))
    assert finetune(tmp_path / "old").returncode == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}
    r = finetune(tmp_path / "old", full)
    assert r.returncode == 2 and "File too large" in _one_error(r.stderr), r.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()} == before
