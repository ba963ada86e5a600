"""mypy over planner/, actors/, disco_ray/ and workloads/ (configured in pyproject.toml) reports no errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_mypy_is_clean():
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"mypy failed (exit {r.returncode}):\n{r.stdout}{r.stderr}"
