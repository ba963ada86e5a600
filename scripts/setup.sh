#!/usr/bin/env bash
# Creates .venv (if missing) and installs disco-ray into it; sourced by run_demo.sh and .ci/run.
# Without a GPU, torch is pinned to the CPU build (2.13.0; an unpinned torch pulls several GB of
# CUDA wheels). With one (nvidia-smi answers), the CUDA build of torch 2.11.0 (the H100 figures of
# docs/BENCHMARKS.md; cluster.yaml pins the same) and the `gpu` extra (CuPy).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -f .venv/.disco-setup ] && [ .venv/.disco-setup -nt pyproject.toml ]; then
  return 0 2>/dev/null || exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.11.0"
  .venv/bin/python -m pip install -q -e '.[test,gpu]'
else
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e '.[test]'
fi
touch .venv/.disco-setup
