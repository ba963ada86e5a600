"""`ray job submit` of `python -m disco_ray.cli.job` to a local cluster with a dashboard, for real.

The working dir is a copy of this checkout's tracked files plus a `.venv` folder that the submit
command's excludes must keep out of the upload (the job fails if it arrives).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid

import pytest

from disco_ray.cli.job import PREFIX
from disco_ray.graph import formats
from tests.runtime_helpers import random_taskgraph

ray = pytest.importorskip("ray")
from tests.ray_cluster import ROOT, LocalCluster  # noqa: E402

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.slow]
EXCLUDES = [".venv/", ".git/", "**/__pycache__/", "*.npz", ".whl/", ".gl/"]
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def _checkout_copy(dst) -> None:
    """This checkout's files as `git` lists them (no .gitignore), plus a fake .venv."""
    r = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    )
    if r.returncode != 0:  # not a git checkout: the packages the job needs
        for d in ("disco_ray", "actors", "planner", "workloads"):
            shutil.copytree(ROOT / d, dst / d, ignore=shutil.ignore_patterns("__pycache__"))
    names = r.stdout.split(b"\0") if r.returncode == 0 else []
    for n in filter(None, names):
        if n.decode().endswith(".gitignore"):
            continue  # Ray also skips git-ignored files: only the excludes list may keep .venv out
        src = ROOT / n.decode()
        if src.is_file():
            (dst / n.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / n.decode())
    (dst / ".venv" / "lib").mkdir(parents=True)
    (dst / ".venv" / "lib" / "big.bin").write_bytes(b"\0" * (1 << 20))


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(checkout_on_path=False)  # the job must find the package in its working dir
    try:
        c.start_head("node_a", num_gpus=2, dashboard=True)
        yield c
    finally:
        left = c.stop()
        assert not left, f"processes of the test cluster still running: {left}"


def _submit(cluster, tmp_path, entry: str) -> str:
    """Submits `entry` (a shell line) with this checkout as working dir; waits; returns the logs."""
    from ray.job_submission import JobSubmissionClient

    wd = tmp_path / "wd"
    wd.mkdir()
    _checkout_copy(wd)
    sid = f"disco-test-{uuid.uuid4().hex[:8]}"
    url = f"http://127.0.0.1:{cluster.dashboard_port}"
    r = subprocess.run(
        [
            cluster.ray,
            "job",
            "submit",
            "--address",
            url,
            "--submission-id",
            sid,
            "--no-wait",
            "--working-dir",
            str(wd),
            "--runtime-env-json",
            json.dumps({"excludes": EXCLUDES}),
            "--",
            "sh",
            "-c",
            entry,  # the CLI quotes each word after "--": a shell line goes through sh -c
        ],
        # Ray 2.60 leaves .venv out by default; switched off, so that the excludes list is what is tested
        env={**cluster.env, "RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    client = JobSubmissionClient(url)
    t_end = time.monotonic() + 240
    status = None
    while time.monotonic() < t_end:
        status = str(client.get_job_status(sid)).rsplit(".", 1)[-1]
        if status in TERMINAL:
            break
        time.sleep(1)
    logs = client.get_job_logs(sid)
    assert status == "SUCCEEDED", f"job {sid}: {status}\n{logs[-4000:]}"
    return logs


def test_job_submit_runs_the_graph_and_logs_its_summary(cluster, tmp_path):
    tg = random_taskgraph(401, n=30, gpus=2)
    formats.save(tg, str(tmp_path / "g.json"))
    entry = (
        "python -c \"import os, sys; sys.exit('.venv was uploaded' if os.path.exists('.venv') else 0)\" && "
        f"python -m disco_ray.cli.job {tmp_path / 'g.json'} --placement spread --check-reference --links"
    )
    logs = _submit(cluster, tmp_path, entry)
    assert "reference: match" in logs and "transfer paths:" in logs, logs[-4000:]
    line = next(ln for ln in logs.splitlines() if ln.startswith(PREFIX))
    summary = json.loads(line[len(PREFIX) :])
    assert summary["vertices"] > 0 and summary["reference"] == "match"
    assert [w["gpu"] for w in summary["placement"]["workers"]] == [0, 1]
    assert summary["placement"]["gpus_per_worker"] == 1.0 and summary["links"]["links"]


def test_job_submit_generates_with_a_checkpoint(cluster, tmp_path):
    pytest.importorskip("transformers")
    from tests.test_models import PROMPT, expected, make_checkpoint

    hf = make_checkpoint(tmp_path / "ckpt", num_key_value_heads=2)
    _, want = expected(hf, PROMPT, 5)
    ids = ",".join(map(str, PROMPT))
    entry = (
        f"python -m disco_ray generate {tmp_path / 'ckpt'} --prompt-ids {ids} --max-new-tokens 5 --gpus 2 "
        "--capacity 512KiB --block 4 --ignore-eos --json --address auto"
    )
    logs = _submit(cluster, tmp_path, entry)
    doc = json.loads(next(ln for ln in logs.splitlines() if ln.startswith("{")))
    assert doc["tokens"] == want and doc["gpus"] == 2 and doc["engine"] == "ray"
